#include "gradwire/wire/codec.h"

#include <algorithm>
#include <cstring>

#include "gradwire/kernels/cpu/cast.h"
#include "gradwire/kernels/dtype.h"
#include "gradwire/kernels/fp8.h"
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

}  // namespace gradwire::wire
