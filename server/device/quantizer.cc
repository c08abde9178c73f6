#include "server/device/quantizer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "gradwire/kernels/cpu/loops.h"
#include "gradwire/kernels/ref/block_scaling.h"
#include "gradwire/kernels/ref/cast.h"

namespace gradwire::device {

float HostScale(const QuantizerConfig& config) {
  if (config.scale_of.has_value()) return config.scale_of->scale();
  if (!config.scale_device.defined()) return config.scale;
  const at::Tensor& s = config.scale_device;
  if (!s.device().is_cpu() || s.scalar_type() != at::kFloat || s.numel() != 1) {
    throw std::logic_error("a host cast was given a scale that is not one fp32 value on the host");
  }
  return *s.data_ptr<float>();
}

void SetBlockScaling(QuantizerConfig& q, ScalingMode mode, bool weight) {
  q.block_scaled = true;
  q.format = kernels::Fp8Format::kE4M3;
  if (mode == ScalingMode::kBlock) {
    constexpr int64_t e = kernels::kBlockScalingEdge;
    q.rowwise_block = weight ? kernels::BlockShape{e, e} : kernels::BlockShape{1, e};
    q.columnwise_block = weight ? kernels::BlockShape{e, e} : kernels::BlockShape{1, e};
  } else {
    q.rowwise_block = {1, kernels::kMxfp8BlockLength};
    q.columnwise_block = {1, kernels::kMxfp8BlockLength};
  }
}

namespace {

float MaxOf(const at::Tensor& t) {
  float m = 0.0f;
  const float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, p[i]);
  return m;
}

// The block-scaled cast (kernels/ref/block_scaling.h): each copy blocked along its own rows.
Fp8Tensor QuantizeBlocked(const float* data, const QuantizerConfig& config, CastUsage usage,
                          Fp8Tensor out, const BlockCastLoops& loops) {
  out.block_scaled = true;
  out.rowwise_block = config.rowwise_block;
  out.columnwise_block = config.columnwise_block;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // The columnwise copy [cols, rows] blocked by {br, bc} is x blocked by {bc, br}, transposed.
  const kernels::BlockShape as_x{config.columnwise_block.cols, config.columnwise_block.rows};
  const bool same = usage.rowwise && usage.columnwise && as_x.rows == config.rowwise_block.rows &&
                    as_x.cols == config.rowwise_block.cols;
  if (usage.rowwise) {
    out.rowwise_scale_inv = at::empty({kernels::BlockGridRows(out.rows, config.rowwise_block),
                                       kernels::BlockGridCols(out.cols, config.rowwise_block)},
                                      f32);
  }
  if (usage.columnwise) {
    out.columnwise_scale_inv = at::empty(
        {kernels::BlockGridCols(out.cols, as_x), kernels::BlockGridRows(out.rows, as_x)}, f32);
  }
  uint8_t* rowwise = usage.rowwise ? out.rowwise.data_ptr<uint8_t>() : nullptr;
  float* rowwise_scale = usage.rowwise ? out.rowwise_scale_inv.data_ptr<float>() : nullptr;
  uint8_t* columnwise = usage.columnwise ? out.columnwise.data_ptr<uint8_t>() : nullptr;
  float* columnwise_scale = usage.columnwise ? out.columnwise_scale_inv.data_ptr<float>() : nullptr;
  // The source's amax (NaN when a value is NaN), for the finite checks and the roles' records.
  float amax = 0.0f;
  // Both copies (or the one wanted) blocked 1 x length along their own rows: one pass, which
  // measures the amax on the way.
  const int64_t length = usage.rowwise ? config.rowwise_block.cols : as_x.rows;
  if (loops.line != nullptr && (!usage.rowwise || config.rowwise_block.rows == 1) &&
      (!usage.columnwise || (as_x.cols == 1 && as_x.rows == length))) {
    loops.line(data, out.rows, out.cols, length, config.format, rowwise, rowwise_scale, columnwise,
               columnwise_scale, &amax);
  } else {
    if (usage.rowwise) {
      loops.quantize(data, out.rows, out.cols, config.rowwise_block, config.format, rowwise,
                     rowwise_scale, same ? columnwise : nullptr, same ? columnwise_scale : nullptr);
    }
    if (usage.columnwise && !same) {
      loops.quantize(data, out.rows, out.cols, as_x, config.format, nullptr, nullptr, columnwise,
                     columnwise_scale);
    }
    amax = loops.amax(data, out.rows * out.cols);
  }
  float max_scale_inv = 0.0f;
  if (usage.rowwise) max_scale_inv = MaxOf(out.rowwise_scale_inv);
  if (usage.columnwise) max_scale_inv = std::max(max_scale_inv, MaxOf(out.columnwise_scale_inv));
  out.max_scale_inv = max_scale_inv > 0.0f ? max_scale_inv : 1.0f;
  out.scalars = CastScalars(1.0f, 1.0f, amax);
  return out;
}

}  // namespace

namespace {

absl::StatusOr<Fp8Tensor> QuantizeOn(const at::Tensor& x, const QuantizerConfig& config,
                                     CastUsage usage, const BlockCastLoops& loops) {
  if (x.dim() != 2 || x.scalar_type() != at::kFloat || !x.is_contiguous() || !x.is_cpu()) {
    return absl::InternalError("Quantize expects a contiguous 2-D float32 CPU tensor");
  }
  if (!usage.rowwise && !usage.columnwise) {
    return absl::InternalError("Quantize asked for neither rowwise nor columnwise data");
  }
  Fp8Tensor out;
  out.format = config.format;
  out.rows = x.size(0);
  out.cols = x.size(1);
  const auto options = at::TensorOptions().dtype(at::kByte);
  if (usage.rowwise) out.rowwise = at::empty({out.rows, out.cols}, options);
  if (usage.columnwise) out.columnwise = at::empty({out.cols, out.rows}, options);
  const float* data = x.data_ptr<float>();
  uint8_t* rowwise = usage.rowwise ? out.rowwise.data_ptr<uint8_t>() : nullptr;
  uint8_t* columnwise = usage.columnwise ? out.columnwise.data_ptr<uint8_t>() : nullptr;
  if (config.block_scaled) {
    if (config.format != kernels::Fp8Format::kE4M3 && config.format != kernels::Fp8Format::kE5M2) {
      return absl::InternalError("Quantize: unknown FP8 format");
    }
    if (config.rowwise_block.rows < 1 || config.rowwise_block.cols < 1 ||
        config.columnwise_block.rows < 1 || config.columnwise_block.cols < 1) {
      return absl::InternalError("Quantize: a block shape must be at least 1 x 1");
    }
    return QuantizeBlocked(data, config, usage, std::move(out), loops);
  }
  if (GivenScale(config)) {  // delayed: the scale is given; amax comes out of the same pass
    const float given = HostScale(config);
    float amax = 0.0f;
    kernels::QuantizeFp8(data, out.rows, out.cols, given, config.format, rowwise, columnwise,
                         &amax);
    out.scalars = CastScalars(given, 1.0f / given, amax);
    return out;
  }
  const float amax = kernels::Amax(data, x.numel());
  const float scale = kernels::ComputeScale(amax, config.format, config.margin);
  out.scalars = CastScalars(scale, 1.0f / scale, amax);
  kernels::QuantizeFp8(data, out.rows, out.cols, scale, config.format, rowwise, columnwise,
                       nullptr);
  return out;
}

}  // namespace

absl::StatusOr<Fp8Tensor> Quantize(const at::Tensor& x, const QuantizerConfig& config,
                                   CastUsage usage) {
  return QuantizeOn(x, config, usage, BlockCastLoops{});
}

absl::StatusOr<Fp8Tensor> QuantizeBlockScaled(const at::Tensor& x, const QuantizerConfig& config,
                                              CastUsage usage, const BlockCastLoops& loops) {
  if (!config.block_scaled) return absl::InternalError("QuantizeBlockScaled of a per-tensor cast");
  return QuantizeOn(x, config, usage, loops);
}

Fp8Tensor FromCodes(const uint8_t* codes, int64_t rows, int64_t cols, kernels::Fp8Format format,
                    float scale_inv, CastUsage usage) {
  Fp8Tensor out;
  out.format = format;
  out.rows = rows;
  out.cols = cols;
  const auto options = at::TensorOptions().dtype(at::kByte);
  const float* table = kernels::DecodeTable(format);
  // max |value| with NaN and inf kept (E5M2 has both, E4M3 a NaN): what a cast's amax would be,
  // so a caller can tell a non-finite input from it.
  uint32_t max_bits = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &table[codes[i]], sizeof bits);
    max_bits = std::max(max_bits, bits & 0x7FFFFFFFu);
  }
  out.scalars =
      CastScalars(1.0f / scale_inv, scale_inv, kernels::cpu::AbsMaxFromBits(max_bits) * scale_inv);
  if (usage.rowwise) {
    out.rowwise = at::empty({rows, cols}, options);
    std::memcpy(out.rowwise.data_ptr<uint8_t>(), codes, size_t(rows * cols));
  }
  if (usage.columnwise) {
    out.columnwise = at::empty({cols, rows}, options);
    uint8_t* t = out.columnwise.data_ptr<uint8_t>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = codes[r * cols + c];
    }
  }
  return out;
}

Fp8Tensor FromBlockCodes(const wire::TensorView& v, int64_t rows, int64_t cols, CastUsage usage) {
  if (!wire::IsFp8(v.dtype) || !v.blocks.present() || rows * cols != v.numel()) {
    throw std::logic_error("FromBlockCodes: not a block-scaled FP8 view of rows x cols");
  }
  Fp8Tensor out;
  out.format =
      v.dtype == wire::DType::kFp8E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2;
  out.rows = rows;
  out.cols = cols;
  out.block_scaled = true;
  const auto bytes = at::TensorOptions().dtype(at::kByte);
  const auto floats = at::TensorOptions().dtype(at::kFloat);
  auto grid = [&](const wire::BlockScales& b, int64_t r, int64_t c) {
    const kernels::BlockShape shape{b.block_rows, b.block_cols};
    at::Tensor t =
        at::empty({kernels::BlockGridRows(r, shape), kernels::BlockGridCols(c, shape)}, floats);
    std::memcpy(t.data_ptr<float>(), b.scale_inv.data(), b.scale_inv.size() * sizeof(float));
    return t;
  };
  const auto* codes = static_cast<const uint8_t*>(v.data);
  out.rowwise_block = {v.blocks.block_rows, v.blocks.block_cols};
  out.rowwise_scale_inv = grid(v.blocks, rows, cols);
  float max_scale_inv = 0.0f;
  for (float s : v.blocks.scale_inv) max_scale_inv = std::max(max_scale_inv, s);
  // The largest |decoded value|, NaN when a code is NaN: what a cast of those values measures.
  // Per block, without decoding: a code's low seven bits order as its magnitude (E4M3's NaN and
  // E5M2's infinities and NaNs above every finite code), so the block's largest of them, decoded
  // and times the block's scale, is its largest |value|.
  const float* table = kernels::DecodeTable(out.format);
  const kernels::BlockShape block = out.rowwise_block;
  const int64_t grid_cols = kernels::BlockGridCols(cols, block);
  std::vector<uint8_t> top(size_t(kernels::BlockGridRows(rows, block) * grid_cols), 0);
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row_top = top.data() + (r / block.rows) * grid_cols;
    const uint8_t* row = codes + r * cols;
    for (int64_t c0 = 0, j = 0; c0 < cols; c0 += block.cols, ++j) {
      uint8_t m = row_top[j];
      for (int64_t c = c0, c1 = std::min(cols, c0 + block.cols); c < c1; ++c) {
        m = std::max<uint8_t>(m, row[c] & 0x7F);
      }
      row_top[j] = m;
    }
  }
  float amax = 0.0f;
  for (size_t i = 0; i < top.size(); ++i) {
    const float a = table[top[i]] * v.blocks.scale_inv[i];
    if (std::isnan(a)) {
      amax = a;
      break;
    }
    amax = std::max(amax, a);
  }
  out.scalars = CastScalars(1.0f, 1.0f, amax);
  if (usage.rowwise) {
    out.rowwise = at::empty({rows, cols}, bytes);
    std::memcpy(out.rowwise.data_ptr<uint8_t>(), codes, size_t(rows * cols));
  }
  if (usage.columnwise && v.columnwise.present()) {
    out.columnwise_block = {v.columnwise.block_rows, v.columnwise.block_cols};
    out.columnwise_scale_inv = grid(v.columnwise, cols, rows);
    out.columnwise = at::empty({cols, rows}, bytes);
    std::memcpy(out.columnwise.data_ptr<uint8_t>(), v.columnwise_codes(), size_t(rows * cols));
    for (float s : v.columnwise.scale_inv) max_scale_inv = std::max(max_scale_inv, s);
  }
  out.max_scale_inv = max_scale_inv > 0.0f ? max_scale_inv : 1.0f;
  return out;
}

namespace {

// Whether FP8 codes that arrived as `v` are a block-scaled cast `q`'s: its row blocks with
// power-of-two scales in the block range, and, when `columnwise`, its columnwise copy so too.
bool BlockCodesServe(const wire::TensorView& v, const QuantizerConfig& q, bool columnwise) {
  auto is = [](const wire::BlockScales& b, kernels::BlockShape shape) {
    return b.present() && b.block_rows == shape.rows && b.block_cols == shape.cols &&
           b.PowersOfTwoInRange();
  };
  return is(v.blocks, q.rowwise_block) && (!columnwise || is(v.columnwise, q.columnwise_block));
}

}  // namespace

bool CodesServeInput(const wire::TensorView& v, ScalingMode mode, bool training) {
  if (!wire::IsFp8(v.dtype)) return false;
  if (!BlockScaled(mode)) return !v.blocks.present();
  if (v.dtype != wire::DType::kFp8E4M3) return false;
  QuantizerConfig q;
  SetBlockScaling(q, mode, /*weight=*/false);
  return BlockCodesServe(v, q, training);
}

bool CodesServeGradient(const wire::TensorView& v, const QuantizerConfig& q) {
  const wire::DType format =
      q.format == kernels::Fp8Format::kE4M3 ? wire::DType::kFp8E4M3 : wire::DType::kFp8E5M2;
  if (v.dtype != format) return false;
  if (!q.block_scaled) return !v.blocks.present();
  return BlockCodesServe(v, q, /*columnwise=*/true);
}

at::Tensor Dequantize(const Fp8Tensor& t, bool rowwise) {
  const at::Tensor& codes = rowwise ? t.rowwise : t.columnwise;
  at::Tensor out = at::empty(codes.sizes(), at::TensorOptions().dtype(at::kFloat));
  DequantizeInto(t, rowwise, out.data_ptr<float>());
  return out;
}

void DequantizeInto(const Fp8Tensor& t, bool rowwise, float* out) {
  const at::Tensor& codes = rowwise ? t.rowwise : t.columnwise;
  if (!t.block_scaled) {
    kernels::DequantizeFp8(codes.data_ptr<uint8_t>(), codes.numel(), t.scale_inv(), t.format, out);
    return;
  }
  const at::Tensor& grid = rowwise ? t.rowwise_scale_inv : t.columnwise_scale_inv;
  kernels::DequantizeBlocks(codes.data_ptr<uint8_t>(), codes.size(0), codes.size(1),
                            rowwise ? t.rowwise_block : t.columnwise_block, grid.data_ptr<float>(),
                            t.format, out);
}

}  // namespace gradwire::device
