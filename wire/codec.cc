#include "gradwire/wire/codec.h"

#include <algorithm>
#include <cstring>

#include "gradwire/kernels/cpu/cast.h"
#include "gradwire/kernels/dtype.h"
#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/block_scaling.h"
#include "gradwire/kernels/ref/cast.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire format is little-endian; this host would need byte swaps");

namespace gradwire::wire {
namespace {

// Elements converted per aligned staging block (the wire bytes may be unaligned).
constexpr int64_t kBlock = 2048;

kernels::Fp8Format Format(DType dtype) {
  return dtype == DType::kFp8E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2;
}

}  // namespace

int64_t ElementSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      return 1;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kFp8E4M3:
      return "FP8_E4M3";
    case DType::kFp8E5M2:
      return "FP8_E5M2";
  }
  return "unknown";
}

int64_t TensorView::numel() const {
  if (shape.empty()) return 0;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool BlockScales::PowersOfTwoInRange() const {
  for (float s : scale_inv) {
    uint32_t bits;
    std::memcpy(&bits, &s, sizeof bits);
    // Positive, mantissa 0, biased exponent e + 127 within the range.
    const int64_t e = int64_t(bits >> 23) - 127;
    if ((bits & 0x807FFFFFu) != 0 || e < kernels::kBlockScaleExponentMin ||
        e > kernels::kBlockScaleExponentMax) {
      return false;
    }
  }
  return true;
}

const uint8_t* TensorView::columnwise_codes() const {
  if (!columnwise.present()) return nullptr;
  return static_cast<const uint8_t*>(data) + numel();
}

void DecodeView(const TensorView& v, float* out) {
  if (!IsFp8(v.dtype) || !v.blocks.present()) {
    DecodeElements(v.dtype, v.data, v.numel(), v.scale_inv, out);
    return;
  }
  kernels::cpu::DequantizeBlocks(static_cast<const uint8_t*>(v.data), v.rows(), v.cols(),
                                 {v.blocks.block_rows, v.blocks.block_cols},
                                 v.blocks.scale_inv.data(), Format(v.dtype), out);
}

void DecodeElements(DType dtype, const void* bytes, int64_t n, float scale_inv, float* out) {
  const auto* src = static_cast<const unsigned char*>(bytes);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, src, size_t(n) * sizeof(float));
      return;
    case DType::kBF16:
    case DType::kF16: {
      uint16_t bits[kBlock];
      for (int64_t i = 0; i < n; i += kBlock) {
        const int64_t m = std::min(kBlock, n - i);
        std::memcpy(bits, src + 2 * i, size_t(m) * 2);
        if (dtype == DType::kBF16) {
          kernels::Bf16ToFloat(bits, m, out + i);
        } else {
          kernels::HalfToFloat(bits, m, out + i);
        }
      }
      return;
    }
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      kernels::DequantizeFp8(src, n, scale_inv, Format(dtype), out);
      return;
  }
}

float Fp8EncodeScale(DType dtype, float amax) {
  return kernels::ComputeScale(amax, Format(dtype), /*margin=*/0);
}

float AbsMax(const float* x, int64_t n) { return kernels::Amax(x, n); }

void EncodeElements(const float* x, int64_t n, DType dtype, float fp8_scale, void* out) {
  auto* dst = static_cast<unsigned char*>(out);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, x, size_t(n) * sizeof(float));
      return;
    case DType::kBF16:
    case DType::kF16: {
      uint16_t bits[kBlock];
      for (int64_t i = 0; i < n; i += kBlock) {
        const int64_t m = std::min(kBlock, n - i);
        if (dtype == DType::kBF16) {
          kernels::FloatToBf16(x + i, m, bits);
        } else {
          kernels::FloatToHalf(x + i, m, bits);
        }
        std::memcpy(dst + 2 * i, bits, size_t(m) * 2);
      }
      return;
    }
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      // The CPU kernels' encoder: the reference cast's codes bit for bit (checked exhaustively
      // in tests/kernels), vectorised and on this thread, several times faster than the
      // reference's rint and ldexp per element.
      kernels::cpu::EncodeFp8(x, n, fp8_scale, Format(dtype), dst);
      return;
  }
}

float EncodeTensor(const float* x, int64_t n, DType dtype, void* out) {
  const float scale = IsFp8(dtype) ? Fp8EncodeScale(dtype, AbsMax(x, n)) : 1.0f;
  EncodeElements(x, n, dtype, scale, out);
  return IsFp8(dtype) ? 1.0f / scale : 1.0f;
}

BlockScales EncodeBlocks(const float* x, int64_t rows, int64_t cols, DType dtype,
                         Fp8Scaling scaling, void* codes, BlockScales* columnwise) {
  const kernels::Fp8Format format = Format(dtype);
  const kernels::BlockShape rowwise{1, scaling.block};
  BlockScales out{1, scaling.block, {}};
  out.scale_inv.resize(
      size_t(kernels::BlockGridRows(rows, rowwise) * kernels::BlockGridCols(cols, rowwise)));
  auto* dst = static_cast<uint8_t*>(codes);
  kernels::cpu::QuantizeBlocks(x, rows, cols, rowwise, format, dst, out.scale_inv.data(), nullptr,
                               nullptr);
  if (scaling.columnwise && columnwise != nullptr) {
    // x blocked by {block, 1} is its transpose blocked by {1, block}: the cast writes the
    // transposed codes and their scale grid [cols, ceil(rows / block)].
    const kernels::BlockShape as_x{scaling.block, 1};
    *columnwise = BlockScales{1, scaling.block, {}};
    columnwise->scale_inv.resize(
        size_t(kernels::BlockGridCols(cols, as_x) * kernels::BlockGridRows(rows, as_x)));
    kernels::cpu::QuantizeBlocks(x, rows, cols, as_x, format, nullptr, nullptr, dst + rows * cols,
                                 columnwise->scale_inv.data());
  }
  return out;
}

EncodedTensor Encode(const float* x, std::vector<int64_t> shape, DType dtype, Fp8Scaling scaling,
                     float known_amax) {
  EncodedTensor e;
  e.dtype = dtype;
  e.shape = std::move(shape);
  int64_t n = e.shape.empty() ? 0 : 1;
  for (int64_t d : e.shape) n *= d;
  const bool blocked = IsFp8(dtype) && scaling.block > 0;
  e.bytes.resize(size_t(blocked ? Fp8Bytes(n, scaling) : n * ElementSize(dtype)));
  if (!blocked && IsFp8(dtype) && known_amax >= 0.0f) {
    const float scale = Fp8EncodeScale(dtype, known_amax);
    EncodeElements(x, n, dtype, scale, e.bytes.data());
    e.scale_inv = 1.0f / scale;
    return e;
  }
  if (!blocked) {
    e.scale_inv = EncodeTensor(x, n, dtype, e.bytes.data());
    return e;
  }
  const int64_t cols = e.shape.empty() ? 0 : e.shape.back();
  const int64_t rows = cols > 0 ? n / cols : 0;
  e.scale_inv = 0.0f;
  e.blocks = EncodeBlocks(x, rows, cols, dtype, scaling, e.bytes.data(),
                          scaling.columnwise ? &e.columnwise : nullptr);
  return e;
}

}  // namespace gradwire::wire
