// The CPU backend, what --device cpu runs: kernels/cpu's threaded, vectorised casts, LayerNorm,
// activations, accumulations and wire conversions (the reference's bits), and the three GEMMs on
// the FP8 GEMM of kernels/cpu/ordered_gemm.h, which also gives the reference's bits (or on the
// process's BLAS with --cpu-gemm blas: cpu_gemm.h). It derives from the reference backend for
// what it does not replace (host tensors in and out, the dequantize).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "gradwire/kernels/cpu/blas.h"
#include "gradwire/kernels/cpu/cast.h"
#include "gradwire/kernels/cpu/layernorm.h"
#include "gradwire/kernels/cpu/loops.h"
#include "gradwire/kernels/cpu/ordered_gemm.h"
#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/cpu/scratch.h"
#include "gradwire/kernels/ref/cast.h"
#include "server/device/backend.h"
#include "server/device/cpu_block_operands.h"
#include "server/device/cpu_gemm.h"
#include "server/device/reference_backend.h"
#include "server/device/reference_ops.h"

namespace gradwire::device {

// A weight's GEMM operand packed once per weight version from its dequantized values (the
// block-scaled recipes: every value is an FP8 value times a power-of-two block scale within the
// exponent range of docs/block-scaling.md, so it is exact in bf16 and the packing keeps it).
class ValuePanels {
 public:
  // One copy of a block-scaled tensor stored [n, k], decoded and scaled as it is packed.
  ValuePanels(const Fp8Tensor& t, bool rowwise, int64_t n, int64_t k)
      : data_(kernels::cpu::PanelBytes(n, k) / sizeof(uint16_t) + 1), n_(n), k_(k) {
    const at::Tensor& grid = rowwise ? t.rowwise_scale_inv : t.columnwise_scale_inv;
    kernels::cpu::PackPanelsFromBlockCodes(
        (rowwise ? t.rowwise : t.columnwise).data_ptr<uint8_t>(), t.format, grid.data_ptr<float>(),
        rowwise ? t.rowwise_block : t.columnwise_block, grid.size(1), n, k, data_.data());
  }
  kernels::cpu::PanelsView view() const { return {n_, k_, data_.data()}; }

 private:
  std::vector<uint16_t> data_;
  int64_t n_, k_;
};

namespace {

// The decoded floats (codes without the scale, in storage order) of one stored copy, in scratch.
kernels::cpu::Scratch Decode(const at::Tensor& codes, kernels::Fp8Format format) {
  kernels::cpu::Scratch out = kernels::cpu::TakeScratch(size_t(codes.numel()) * sizeof(float));
  kernels::cpu::DecodeCodes(codes.data_ptr<uint8_t>(), codes.numel(), format, out.floats());
  return out;
}

// The B operand of an FP8 GEMM, packed (kernels/cpu/ordered_gemm.h): a weight's panels from its
// workspace, else packed now into scratch.
struct Panels {
  kernels::cpu::PanelsView view;
  kernels::cpu::Scratch lease;
};

// Packs B [n, k] from stored codes: `n_major` when the codes are stored [n, k], else [k, n].
Panels PackNow(const at::Tensor& codes, kernels::Fp8Format format, int64_t n, int64_t k,
               bool n_major) {
  Panels p;
  p.lease = kernels::cpu::TakeScratch(kernels::cpu::PanelBytes(n, k));
  auto* out = static_cast<uint16_t*>(p.lease.data());
  kernels::cpu::PackPanelsFromCodes(codes.data_ptr<uint8_t>(), format, n, k, n_major, out);
  p.view = {n, k, out};
  return p;
}

// W [N, K] as the forward's B (n = N, k = K): its rows are B's.
Panels FpropPanels(const Fp8Tensor& w) {
  if (w.fprop_panels) return {w.fprop_panels->view(), {}};
  if (w.has_rowwise()) return PackNow(w.rowwise, w.format, w.rows, w.cols, true);
  return PackNow(w.columnwise, w.format, w.rows, w.cols, false);
}

// W^T [K, N] as the input gradient's B (n = K, k = N): the columnwise copy's rows are B's.
Panels DgradPanels(const Fp8Tensor& w) {
  if (w.dgrad_panels) return {w.dgrad_panels->view(), {}};
  if (w.has_columnwise()) return PackNow(w.columnwise, w.format, w.cols, w.rows, true);
  return PackNow(w.rowwise, w.format, w.cols, w.rows, false);
}

// DequantizeInto, a block-scaled tensor's on the threaded loop (kernels/cpu/cast.h).
void DequantizeBlocksInto(const Fp8Tensor& t, bool rowwise, float* out) {
  if (!t.block_scaled) return DequantizeInto(t, rowwise, out);
  const at::Tensor& codes = rowwise ? t.rowwise : t.columnwise;
  const at::Tensor& grid = rowwise ? t.rowwise_scale_inv : t.columnwise_scale_inv;
  kernels::cpu::DequantizeBlocks(codes.data_ptr<uint8_t>(), codes.size(0), codes.size(1),
                                 rowwise ? t.rowwise_block : t.columnwise_block,
                                 grid.data_ptr<float>(), t.format, out);
}

// One stored copy of a block-scaled tensor, dequantized block by block into scratch.
kernels::cpu::Scratch DequantizeToScratch(const Fp8Tensor& t, bool rowwise) {
  kernels::cpu::Scratch out = kernels::cpu::TakeScratch(size_t(t.rows * t.cols) * sizeof(float));
  DequantizeBlocksInto(t, rowwise, out.floats());
  return out;
}

// Packs B [n, k] from values stored [n, k] into scratch.
Panels PackValuesNow(const float* values, int64_t n, int64_t k) {
  Panels p;
  p.lease = kernels::cpu::TakeScratch(kernels::cpu::PanelBytes(n, k));
  auto* out = static_cast<uint16_t*>(p.lease.data());
  kernels::cpu::PackPanels(values, n, k, k, /*n_major=*/true, out);
  p.view = {n, k, out};
  return p;
}

// Packs B [n, k] from one copy of a block-scaled tensor stored [n, k] (its rowwise copy, or its
// columnwise one), decoded and scaled as it is packed.
Panels PackBlockCodesNow(const Fp8Tensor& t, bool rowwise, int64_t n, int64_t k) {
  if (!t.block_scaled) {
    const kernels::cpu::Scratch values = DequantizeToScratch(t, rowwise);
    return PackValuesNow(values.floats(), n, k);
  }
  const at::Tensor& grid = rowwise ? t.rowwise_scale_inv : t.columnwise_scale_inv;
  Panels p;
  p.lease = kernels::cpu::TakeScratch(kernels::cpu::PanelBytes(n, k));
  auto* out = static_cast<uint16_t*>(p.lease.data());
  kernels::cpu::PackPanelsFromBlockCodes(
      (rowwise ? t.rowwise : t.columnwise).data_ptr<uint8_t>(), t.format, grid.data_ptr<float>(),
      rowwise ? t.rowwise_block : t.columnwise_block, grid.size(1), n, k, out);
  p.view = {n, k, out};
  return p;
}

// A block-scaled weight as the forward's B (W [N, K], its rowwise copy) or the input gradient's
// (W^T [K, N], its columnwise copy): the workspace's panels, else packed now.
Panels BlockWeightPanels(const Fp8Tensor& w, bool fprop) {
  const std::shared_ptr<const ValuePanels>& kept =
      fprop ? w.fprop_value_panels : w.dgrad_value_panels;
  if (kept) return {kept->view(), {}};
  return fprop ? PackBlockCodesNow(w, true, w.rows, w.cols)
               : PackBlockCodesNow(w, false, w.cols, w.rows);
}

// The rowwise copies of a (possibly row-grouped) block-scaled tensor, dequantized and stacked by
// rows into one scratch operand [rows, cols]: each group's values are its own cast's.
kernels::cpu::Scratch StackDequantized(const Fp8Tensor& t) {
  if (!t.grouped()) return DequantizeToScratch(t, true);
  kernels::cpu::Scratch out = kernels::cpu::TakeScratch(size_t(t.rows * t.cols) * sizeof(float));
  int64_t row = 0;
  for (const Fp8Tensor& g : t.groups) {
    DequantizeBlocksInto(g, true, out.floats() + row * t.cols);
    row += g.rows;
  }
  return out;
}

// C[m, n] = alpha * op(A) . op(B) + beta * C, row-major (see kernels/cpu/blas.h), on the BLAS the
// process has; through libtorch's matmul on views when none was found there.
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          const float* b, float beta, float* c) {
  const int64_t lda = trans_a ? m : k, ldb = trans_b ? k : n;
  if (kernels::cpu::Sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, n)) return;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor ta = at::from_blob(const_cast<float*>(a), {trans_a ? k : m, lda}, f32);
  at::Tensor tb = at::from_blob(const_cast<float*>(b), {trans_b ? n : k, ldb}, f32);
  at::Tensor tc = at::from_blob(c, {m, n}, f32);
  tc.addmm_(trans_a ? ta.t() : ta, trans_b ? tb.t() : tb, beta, alpha);
}

std::atomic<CpuGemm> g_cpu_gemm{CpuGemm::kOrdered};

// C[m, n] (+)= (A[m, k] . B^T) * scale (+ bias) on the FP8 GEMM (cpu_gemm.h), A from its FP8
// codes (decoded as the GEMM packs them); with row_scale, row i takes row_scale[i] instead of
// scale.
// A_decoded, when set, is A already decoded to floats (a_codes is then ignored).
void Ordered(int64_t m, float scale, const uint8_t* a_codes, kernels::Fp8Format a_format,
             const kernels::cpu::PanelsView& b, const float* bias, float* c,
             const float* row_scale = nullptr, bool accumulate = false,
             const float* a_decoded = nullptr, const BlockedOperand* a_blocked = nullptr) {
  kernels::cpu::OrderedGemmArgs g;
  g.m = m;
  g.a = a_decoded;
  g.a_codes = a_decoded != nullptr ? nullptr : a_codes;
  if (a_blocked != nullptr && a_blocked->codes != nullptr) {
    g.a = nullptr;
    g.a_codes = a_blocked->codes;
    g.a_block_scale = a_blocked->grid;
    g.a_block = a_blocked->block;
    g.a_block_ld = a_blocked->grid_ld;
    g.a_format = a_blocked->format;
  }
  g.a_format = a_format;
  g.lda = b.k;
  g.b = b;
  g.scale = scale;
  g.row_scale = row_scale;
  g.bias = bias;
  g.accumulate = accumulate;
  g.c = c;
  g.ldc = b.n;
  kernels::cpu::OrderedGemm(g);
}

// Times one GEMM into the FP8 GEMM counters (metrics).
class GemmTimer {
 public:
  explicit GemmTimer(double flops) : flops_(flops), start_(std::chrono::steady_clock::now()) {}
  ~GemmTimer() {
    CountGemm(flops_,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }

 private:
  double flops_;
  std::chrono::steady_clock::time_point start_;
};

constexpr int64_t kWireGrain = int64_t(1) << 16;  // elements per thread's slice, at least

// A bfloat16 host tensor widened to fp32 (exact, as the wire codec decodes it) into `to`, or
// into scratch, split over the pool.
void WidenBf16Into(const at::Tensor& t, float* to) {
  const at::Tensor src = t.contiguous();
  const auto* from = static_cast<const unsigned char*>(src.data_ptr());
  kernels::cpu::ParallelFor(src.numel(), kWireGrain, [&](int64_t b, int64_t e) {
    wire::DecodeElements(wire::DType::kBF16, from + b * 2, e - b, 1.0f, to + b);
  });
}
kernels::cpu::Scratch WidenBf16(const at::Tensor& t) {
  kernels::cpu::Scratch out = kernels::cpu::TakeScratch(size_t(t.numel()) * 4);
  WidenBf16Into(t, out.floats());
  return out;
}

at::TensorOptions Bytes() { return at::TensorOptions().dtype(at::kByte); }

// What --device cpu runs. Every loop over activations is one of kernels/cpu's (threaded on its
// pool, vectorised, no allocation but the results), the GEMMs are BLAS's on the decoded FP8
// operands, and nothing in a forward or backward goes through a generic tensor op.
class CpuBackend final : public ReferenceBackend {
 public:
  const char* name() const override { return "cpu"; }
  bool SumsColumnsInRowOrder() const override { return true; }  // kernels::cpu::AddColumnSums

  // Its own Widen and NarrowBf16 (the wire codec's, threaded), PrepareWeight (the GEMM panels),
  // FpropInto and DgradInto (the GEMMs write a caller's destination in place), and on the
  // row-invariant GEMM one GEMM for a whole batch (FpropGroups, DgradGroups).
  bool Supports(Op op) const override {
    switch (op) {
      case Op::kWiden:
      case Op::kNarrowBf16:
      case Op::kPrepareWeight:
      case Op::kFpropInto:
      case Op::kDgradInto:
        return true;
      case Op::kFpropGroups:
      case Op::kDgradGroups:
        return GetCpuGemm() == CpuGemm::kOrdered;
      default:
        return Backend::Supports(op);
    }
  }

  std::string Describe() const override {
    const bool pool = kernels::cpu::GetGemmThreads() == kernels::cpu::GemmThreads::kPool;
    const std::string threads = std::to_string(kernels::cpu::Threads()) + " threads";
    if (GetCpuGemm() == CpuGemm::kOrdered) {
      return "host CPU, FP8 casts and loops on " + threads +
             ", GEMMs on the row-invariant FP8 GEMM (" +
             kernels::cpu::OrderedGemmCopyName(kernels::cpu::OrderedGemmActiveCopy()) +
             " micro-kernel, bit for bit the reference GEMM) on the same threads";
    }
    return "host CPU, FP8 casts and loops on " + threads + ", GEMMs on " +
           kernels::cpu::BlasDescription() +
           (pool ? " (split over the same threads)" : " (its own threads)");
  }

  // The reference cast's codes, scale, scale_inv and amax bit for bit (kernels/cpu/cast.h; the
  // parity harness checks it), in one threaded pass that writes both copies.
  absl::StatusOr<Fp8Tensor> Cast(const at::Tensor& x, const QuantizerConfig& config,
                                 CastUsage usage) const override {
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    if (x.dim() != 2 || (x.scalar_type() != at::kFloat && !bf16) || !x.is_contiguous() ||
        !x.is_cpu() || (!usage.rowwise && !usage.columnwise)) {
      return ReferenceBackend::Cast(x, config, usage);  // refused there, with its message
    }
    // The block-scaled recipes' cast: the reference's (kernels/ref/block_scaling.h) on the
    // threaded loops of kernels/cpu/cast.h, bit for bit; bfloat16 widens exactly first.
    if (config.block_scaled) {
      static constexpr BlockCastLoops kLoops{&kernels::cpu::QuantizeBlocks, &kernels::cpu::AbsMax,
                                             &kernels::cpu::QuantizeLineBlocks};
      if (!bf16) return QuantizeBlockScaled(x, config, usage, kLoops);
      const kernels::cpu::Scratch wide = WidenBf16(x);
      const at::Tensor values =
          at::from_blob(wide.floats(), x.sizes(), at::TensorOptions().dtype(at::kFloat));
      return QuantizeBlockScaled(values, config, usage, kLoops);
    }
    Fp8Tensor out;
    out.format = config.format;
    out.rows = x.size(0);
    out.cols = x.size(1);
    // bfloat16 is widened (exactly, as the wire codec decodes it) into scratch first.
    kernels::cpu::Scratch widened;
    if (bf16) widened = WidenBf16(x);
    const float* data = bf16 ? widened.floats() : x.data_ptr<float>();
    const bool delayed = GivenScale(config);
    float scale = HostScale(config);
    float amax = 0.0f;
    if (!delayed) {
      amax = kernels::cpu::AbsMax(data, x.numel());
      scale = kernels::ComputeScale(amax, config.format, config.margin);
    }
    if (usage.rowwise) out.rowwise = at::empty({out.rows, out.cols}, Bytes());
    if (usage.columnwise) out.columnwise = at::empty({out.cols, out.rows}, Bytes());
    kernels::cpu::QuantizeFp8(data, out.rows, out.cols, scale, config.format,
                              usage.rowwise ? out.rowwise.data_ptr<uint8_t>() : nullptr,
                              usage.columnwise ? out.columnwise.data_ptr<uint8_t>() : nullptr,
                              delayed ? &amax : nullptr);
    out.scalars = CastScalars(scale, 1.0f / scale, amax);
    return out;
  }

  Fp8Tensor FromCodes(const uint8_t* host_codes, int64_t rows, int64_t cols,
                      kernels::Fp8Format format, float scale_inv, CastUsage usage) const override {
    Fp8Tensor out;
    out.format = format;
    out.rows = rows;
    out.cols = cols;
    // The largest |value| without decoding: a code's low seven bits order as its magnitude
    // (E4M3's NaN code and E5M2's infinity and NaN codes above every finite one), so the largest
    // of them decodes to the AbsMax of the decoded values, NaN and infinity included.
    uint8_t top = 0;
    for (int64_t i = 0, n = rows * cols; i < n; ++i) {
      const uint8_t magnitude = host_codes[i] & 0x7F;
      top = magnitude > top ? magnitude : top;
    }
    out.scalars =
        CastScalars(1.0f / scale_inv, scale_inv, kernels::DecodeTable(format)[top] * scale_inv);
    if (usage.rowwise) {
      out.rowwise = at::empty({rows, cols}, Bytes());
      std::memcpy(out.rowwise.data_ptr<uint8_t>(), host_codes, size_t(rows * cols));
    }
    if (usage.columnwise) {
      out.columnwise = at::empty({cols, rows}, Bytes());
      kernels::cpu::TransposeCodes(host_codes, rows, cols, out.columnwise.data_ptr<uint8_t>());
    }
    return out;
  }

  // The wire codec split over the pool: elementwise, so the bytes are the reference's; an FP8
  // encode takes one scale from the whole tensor's amax, as the codec does.
  at::Tensor FromWire(const wire::TensorView& v, int64_t rows, int64_t cols, Fp8Tensor* codes,
                      CastUsage usage) const override {
    if (v.blocks.present()) return HostFromBlockScaledWire(v, rows, cols, codes, usage);
    if (wire::IsFp8(v.dtype) && codes != nullptr) {
      *codes = FromCodes(static_cast<const uint8_t*>(v.data), rows, cols, Fp8FormatOf(v.dtype),
                         v.scale_inv, usage);
    }
    if (at::Tensor borrowed = BorrowF32(v, rows, cols); borrowed.defined()) return borrowed;
    at::Tensor decoded = Empty({rows, cols});
    float* out = decoded.data_ptr<float>();
    const int64_t size = wire::ElementSize(v.dtype);
    const auto* bytes = static_cast<const unsigned char*>(v.data);
    kernels::cpu::ParallelFor(v.numel(), kWireGrain, [&](int64_t b, int64_t e) {
      wire::DecodeElements(v.dtype, bytes + b * size, e - b, v.scale_inv, out + b);
    });
    return decoded;
  }
  // The wire codec's widening, split over the pool.
  at::Tensor Widen(const at::Tensor& x) const override {
    if (x.scalar_type() != at::kBFloat16) return ReferenceBackend::Widen(x);
    at::Tensor out = Empty(x.sizes());
    WidenBf16Into(x, out.data_ptr<float>());
    return out;
  }

  // The wire codec's rounding, split over the pool.
  at::Tensor NarrowBf16(const at::Tensor& x) const override {
    const at::Tensor src = x.contiguous();
    at::Tensor out = at::empty(src.sizes(), at::TensorOptions().dtype(at::kBFloat16));
    const float* in = src.data_ptr<float>();
    auto* bytes = static_cast<unsigned char*>(out.data_ptr());
    kernels::cpu::ParallelFor(src.numel(), kWireGrain, [&](int64_t b, int64_t e) {
      wire::EncodeElements(in + b, e - b, wire::DType::kBF16, 1.0f, bytes + b * 2);
    });
    return out;
  }

  wire::EncodedTensor ToWire(const at::Tensor& x, wire::DType dtype,
                             std::vector<int64_t> shape) const override {
    if (x.scalar_type() == at::kBFloat16 && dtype == wire::DType::kBF16) {
      return Bf16AsItIs(x, std::move(shape));
    }
    const at::Tensor src = ToHost(x.to(at::kFloat));
    const float* in = src.data_ptr<float>();
    const int64_t n = src.numel();
    wire::EncodedTensor encoded = EncodedFor(dtype, std::move(shape), n);
    float scale = 1.0f;
    if (wire::IsFp8(dtype)) scale = wire::Fp8EncodeScale(dtype, kernels::cpu::AbsMax(in, n));
    const int64_t size = wire::ElementSize(dtype);
    auto* bytes = reinterpret_cast<unsigned char*>(encoded.bytes.data());
    kernels::cpu::ParallelFor(n, kWireGrain, [&](int64_t b, int64_t e) {
      wire::EncodeElements(in + b, e - b, dtype, scale, bytes + b * size);
    });
    encoded.scale_inv = wire::IsFp8(dtype) ? 1.0f / scale : 1.0f;
    return encoded;
  }

  // A weight's GEMM panels, once per weight version: W for the forward, and W^T for the input
  // gradient when the workspace is built for training. Under --cpu-gemm blas nothing is kept
  // (each GEMM decodes what it reads).
  void PrepareWeight(Fp8Tensor& w) const override {
    if (GetCpuGemm() != CpuGemm::kOrdered) return;
    if (w.block_scaled) {  // panels of the dequantized values
      if (w.has_rowwise()) {
        w.fprop_value_panels = std::make_shared<const ValuePanels>(w, true, w.rows, w.cols);
      }
      if (w.has_columnwise()) {
        w.dgrad_value_panels = std::make_shared<const ValuePanels>(w, false, w.cols, w.rows);
      }
      return;
    }
    if (w.has_rowwise()) {
      w.fprop_panels = std::make_shared<const kernels::cpu::GemmPanels>(
          w.rowwise.data_ptr<uint8_t>(), w.format, w.rows, w.cols, true);
    }
    if (w.has_columnwise()) {
      w.dgrad_panels = std::make_shared<const kernels::cpu::GemmPanels>(
          w.columnwise.data_ptr<uint8_t>(), w.format, w.cols, w.rows, true);
    }
  }

  // A bf16 x is widened first (threaded, exact).
  LayerNormOut LayerNormForward(const at::Tensor& x_in, const LayerNormParams& ln) const override {
    const at::Tensor x = Widen(x_in);
    const int64_t m = x.size(0), k = x.size(1);
    LayerNormOut out{Empty({m, k}), Empty({m}), Empty({m})};
    kernels::cpu::LayerNormForward(x.data_ptr<float>(), m, k, ln.gamma.data_ptr<float>(),
                                   ln.beta.data_ptr<float>(), ln.eps, ln.zero_centered_gamma,
                                   out.y.data_ptr<float>(), out.mu.data_ptr<float>(),
                                   out.rstd.data_ptr<float>());
    return out;
  }
  at::Tensor LayerNormBackward(const at::Tensor& dy, const at::Tensor& x_in, const at::Tensor& mu,
                               const at::Tensor& rstd, const LayerNormParams& ln,
                               at::Tensor& gamma_grad, at::Tensor& beta_grad) const override {
    const at::Tensor x = Widen(x_in);
    at::Tensor dx = Empty(x.sizes());
    kernels::cpu::LayerNormBackward(dy.data_ptr<float>(), x.data_ptr<float>(), mu.data_ptr<float>(),
                                    rstd.data_ptr<float>(), ln.gamma.data_ptr<float>(), x.size(0),
                                    x.size(1), ln.zero_centered_gamma, dx.data_ptr<float>(),
                                    gamma_grad.data_ptr<float>(), beta_grad.data_ptr<float>());
    return dx;
  }

  at::Tensor ActivationForward(kernels::Activation act, const at::Tensor& in,
                               int64_t width) const override {
    at::Tensor out = Empty({in.size(0), width});
    kernels::cpu::ActivationForward(act, in.data_ptr<float>(), in.size(0), width,
                                    out.data_ptr<float>());
    return out;
  }
  at::Tensor ActivationBackward(kernels::Activation act, const at::Tensor& dout,
                                const at::Tensor& in, int64_t width) const override {
    at::Tensor din = Empty(in.sizes());
    kernels::cpu::ActivationBackward(act, dout.data_ptr<float>(), in.data_ptr<float>(), in.size(0),
                                     width, din.data_ptr<float>());
    return din;
  }

  // y = (x . w^T) * (scale_inv_x * scale_inv_w) (+ bias).
  at::Tensor Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias) const override {
    at::Tensor y = Empty({x.rows, w.rows});
    FpropInto(x, w, bias, y);
    return y;
  }
  // Every GEMM below writes each output element without reading it first (BLAS with beta 0, or
  // after FillRows), so a destination's earlier contents never matter.
  void FpropInto(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias,
                 at::Tensor& y) const override {
    if (!IntoHostF32(y, x.rows, w.rows)) return Backend::FpropInto(x, w, bias, y);
    if (x.block_scaled || w.block_scaled) return BlockFprop(x, w, bias, y);
    GemmTimer timer(2.0 * double(x.rows) * double(w.rows) * double(x.cols));
    const float* bias_data = bias.defined() ? bias.data_ptr<float>() : nullptr;
    if (GetCpuGemm() == CpuGemm::kOrdered) {  // the reference's arithmetic
      const Panels b = FpropPanels(w);
      Ordered(x.rows, x.scale_inv() * w.scale_inv(), x.rowwise.data_ptr<uint8_t>(), x.format,
              b.view, bias_data, y.data_ptr<float>());
      return;
    }
    const kernels::cpu::Scratch a = Decode(x.rowwise, x.format);
    if (bias_data != nullptr)
      kernels::cpu::FillRows(bias_data, x.rows, w.rows, y.data_ptr<float>());
    const bool rowwise = w.has_rowwise();
    const kernels::cpu::Scratch b = Decode(rowwise ? w.rowwise : w.columnwise, w.format);
    Gemm(false, rowwise, x.rows, w.rows, x.cols, x.scale_inv() * w.scale_inv(), a.floats(),
         b.floats(), bias_data != nullptr ? 1.0f : 0.0f, y.data_ptr<float>());
  }
  // On the FP8 GEMM every product writes in place; under --cpu-gemm blas a block-scaled one runs
  // the reference's GEMM and is copied in.
  bool GemmsWriteInPlace() const override { return GetCpuGemm() == CpuGemm::kOrdered; }
  // Whether t is a float32, contiguous host tensor of rows x cols: a destination the GEMMs here
  // write in place.
  static bool IntoHostF32(const at::Tensor& t, int64_t rows, int64_t cols) {
    return t.defined() && t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
           t.dim() == 2 && t.size(0) == rows && t.size(1) == cols;
  }
  // A batch's rows in one GEMM: each group's codes decoded into its rows of one operand, each
  // row scaled by its group's scale_inv. Row-invariance makes every row the bits of its group's
  // Fprop alone; BLAS is not row-invariant, so under it each group runs its own Fprop.
  at::Tensor FpropGroups(const Fp8Tensor& x, const Fp8Tensor& w,
                         const at::Tensor& bias) const override {
    if (GetCpuGemm() != CpuGemm::kOrdered) return Backend::FpropGroups(x, w, bias);
    if (w.block_scaled) {
      at::Tensor y = Empty({x.rows, w.rows});
      BlockFprop(x, w, bias, y);
      return y;
    }
    GemmTimer timer(2.0 * double(x.rows) * double(w.rows) * double(x.cols));
    const Panels b = FpropPanels(w);
    const GroupedRows a = StackGroups(x, w.scale_inv());
    at::Tensor y = Empty({x.rows, w.rows});
    Ordered(x.rows, 1.0f, a.codes(), x.format, b.view,
            bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(),
            a.row_scale.data(), false, a.decoded());
    return y;
  }
  // The A operand of a batch's GEMM: each group's codes copied into its rows of one scratch
  // operand (decoded to floats instead when the groups' formats differ: FP8 inputs that came in
  // both wire formats), and each row's scale (its group's scale_inv x the other operand's), which
  // is the scalar the group's own GEMM would use.
  struct GroupedRows {
    kernels::cpu::Scratch rows;
    bool is_decoded = false;
    std::vector<float> row_scale;
    const uint8_t* codes() const { return static_cast<const uint8_t*>(rows.data()); }
    const float* decoded() const { return is_decoded ? rows.floats() : nullptr; }
  };
  static GroupedRows StackGroups(const Fp8Tensor& x, float other_scale_inv) {
    GroupedRows out;
    for (const Fp8Tensor& g : x.groups) out.is_decoded |= g.format != x.format;
    out.rows = kernels::cpu::TakeScratch(size_t(x.rows * x.cols) * (out.is_decoded ? 4 : 1));
    out.row_scale.reserve(size_t(x.rows));
    int64_t row = 0;
    for (const Fp8Tensor& g : x.groups) {
      if (out.is_decoded) {
        kernels::cpu::DecodeCodes(g.rowwise.data_ptr<uint8_t>(), g.rows * g.cols, g.format,
                                  out.rows.floats() + row * x.cols);
      } else {
        std::memcpy(static_cast<uint8_t*>(out.rows.data()) + row * x.cols,
                    g.rowwise.data_ptr<uint8_t>(), size_t(g.rows * g.cols));
      }
      out.row_scale.insert(out.row_scale.end(), size_t(g.rows), g.scale_inv() * other_scale_inv);
      row += g.rows;
    }
    return out;
  }
  at::Tensor Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) const override {
    at::Tensor dx = Empty({dy.rows, w.cols});
    DgradInto(dy, w, dx);
    return dx;
  }
  void DgradInto(const Fp8Tensor& dy, const Fp8Tensor& w, at::Tensor& dx) const override {
    if (!IntoHostF32(dx, dy.rows, w.cols)) return Backend::DgradInto(dy, w, dx);
    if (dy.block_scaled || w.block_scaled) return BlockDgrad(dy, w, dx);
    GemmTimer timer(2.0 * double(dy.rows) * double(w.cols) * double(dy.cols));
    if (GetCpuGemm() == CpuGemm::kOrdered) {
      const Panels b = DgradPanels(w);
      Ordered(dy.rows, dy.scale_inv() * w.scale_inv(), dy.rowwise.data_ptr<uint8_t>(), dy.format,
              b.view, nullptr, dx.data_ptr<float>());
      return;
    }
    const kernels::cpu::Scratch a = Decode(dy.rowwise, dy.format);
    // W [N, K] rowwise when it has it, else W^T [K, N] as a transposed operand.
    const bool rowwise = w.has_rowwise();
    const kernels::cpu::Scratch b = Decode(rowwise ? w.rowwise : w.columnwise, w.format);
    Gemm(false, !rowwise, dy.rows, w.cols, dy.cols, dy.scale_inv() * w.scale_inv(), a.floats(),
         b.floats(), 0.0f, dx.data_ptr<float>());
  }
  // A batch of backwards in one input-gradient GEMM, as FpropGroups does.
  at::Tensor DgradGroups(const Fp8Tensor& dy, const Fp8Tensor& w) const override {
    if (GetCpuGemm() != CpuGemm::kOrdered) return Backend::DgradGroups(dy, w);
    if (w.block_scaled) {
      at::Tensor dx = Empty({dy.rows, w.cols});
      BlockDgrad(dy, w, dx);
      return dx;
    }
    GemmTimer timer(2.0 * double(dy.rows) * double(w.cols) * double(dy.cols));
    const Panels b = DgradPanels(w);
    const GroupedRows a = StackGroups(dy, w.scale_inv());
    at::Tensor dx = Empty({dy.rows, w.cols});
    Ordered(dy.rows, 1.0f, a.codes(), dy.format, b.view, nullptr, dx.data_ptr<float>(),
            a.row_scale.data(), false, a.decoded());
    return dx;
  }
  // acc[N, K] (+)= dY^T [N, M] . X [M, K]: A is dY's columnwise copy, B is X^T (n = K, k = M),
  // packed from X's columnwise copy.
  void Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc,
             bool accumulate) const override {
    if (dy.block_scaled || x.block_scaled) {
      if (GetCpuGemm() != CpuGemm::kOrdered) return ReferenceBackend::Wgrad(dy, x, acc, accumulate);
      GemmTimer timer(2.0 * double(dy.cols) * double(x.cols) * double(dy.rows));
      const BlockedOperand blocked = BlockedA(dy, false);  // dY^T [N, M]
      const kernels::cpu::Scratch a =
          blocked.codes ? kernels::cpu::Scratch() : DequantizeToScratch(dy, false);
      const Panels b = PackBlockCodesNow(x, false, x.cols, x.rows);  // X^T [K, M]
      Ordered(dy.cols, 1.0f, nullptr, dy.format, b.view, nullptr, acc.data_ptr<float>(), nullptr,
              accumulate, a.floats(), &blocked);
      return;
    }
    GemmTimer timer(2.0 * double(dy.cols) * double(x.cols) * double(dy.rows));
    if (GetCpuGemm() == CpuGemm::kOrdered) {  // A: dY^T [N, M], dy's columnwise codes
      const Panels b = PackNow(x.columnwise, x.format, x.cols, x.rows, true);
      Ordered(dy.cols, dy.scale_inv() * x.scale_inv(), dy.columnwise.data_ptr<uint8_t>(), dy.format,
              b.view, nullptr, acc.data_ptr<float>(), nullptr, accumulate);
      return;
    }
    const kernels::cpu::Scratch a = Decode(dy.columnwise, dy.format);  // dY^T [N, M]
    const kernels::cpu::Scratch b = Decode(x.columnwise, x.format);    // X^T [K, M]
    Gemm(false, true, dy.cols, x.cols, dy.rows, dy.scale_inv() * x.scale_inv(), a.floats(),
         b.floats(), accumulate ? 1.0f : 0.0f, acc.data_ptr<float>());
  }
  // The block-scaled GEMMs (docs/block-scaling.md): the operands' dequantized values (exact in
  // bf16) on the same row-invariant GEMM with scale 1, a batch's groups stacked into one A, so
  // every row is the bits of its group alone and of the reference. Under --cpu-gemm blas, the
  // reference's GEMM.
  // Into y [x.rows, w.rows] (host, float32, contiguous).
  void BlockFprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias,
                  at::Tensor& y) const {
    if (GetCpuGemm() != CpuGemm::kOrdered) {
      y.copy_(x.grouped() ? Backend::FpropGroups(x, w, bias) : ReferenceBackend::Fprop(x, w, bias));
      return;
    }
    GemmTimer timer(2.0 * double(x.rows) * double(w.rows) * double(x.cols));
    const Panels b = BlockWeightPanels(w, /*fprop=*/true);
    const BlockedOperand blocked = BlockedA(x, true);
    const kernels::cpu::Scratch a = blocked.codes ? kernels::cpu::Scratch() : StackDequantized(x);
    Ordered(x.rows, 1.0f, nullptr, x.format, b.view,
            bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(), nullptr, false,
            a.floats(), &blocked);
  }
  // Into dx [dy.rows, w.cols] (host, float32, contiguous).
  void BlockDgrad(const Fp8Tensor& dy, const Fp8Tensor& w, at::Tensor& dx) const {
    if (GetCpuGemm() != CpuGemm::kOrdered) {
      dx.copy_(dy.grouped() ? Backend::DgradGroups(dy, w) : ReferenceBackend::Dgrad(dy, w));
      return;
    }
    GemmTimer timer(2.0 * double(dy.rows) * double(w.cols) * double(dy.cols));
    const Panels b = BlockWeightPanels(w, /*fprop=*/false);
    const BlockedOperand blocked = BlockedA(dy, true);
    const kernels::cpu::Scratch a = blocked.codes ? kernels::cpu::Scratch() : StackDequantized(dy);
    Ordered(dy.rows, 1.0f, nullptr, dy.format, b.view, nullptr, dx.data_ptr<float>(), nullptr,
            false, a.floats(), &blocked);
  }

  void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) const override {
    if (g.scalar_type() == at::kBFloat16) {
      const kernels::cpu::Scratch widened = WidenBf16(g);
      kernels::cpu::AddColumnSums(widened.floats(), g.size(0), g.size(1), acc.data_ptr<float>());
      return;
    }
    kernels::cpu::AddColumnSums(g.data_ptr<float>(), g.size(0), g.size(1), acc.data_ptr<float>());
  }

  float AbsMax(const at::Tensor& x) const override {
    return kernels::cpu::AbsMax(x.data_ptr<float>(), x.numel());
  }
  float AddAbsMax(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) const override {
    return kernels::cpu::AddAbsMax(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(),
                                   out.numel());
  }
};

}  // namespace

void SetCpuThreads(int threads, bool gemm_on_blas_threads) {
  kernels::cpu::SetThreads(threads);
  kernels::cpu::SetGemmThreads(gemm_on_blas_threads ? kernels::cpu::GemmThreads::kBlas
                                                    : kernels::cpu::GemmThreads::kPool);
  // libtorch's own intra-op pool would be a third set of threads on the same cores; what still
  // runs through libtorch (optimizer steps, copies out) runs on the calling thread.
  at::set_num_threads(1);
}

void SetCpuGemm(CpuGemm gemm) { g_cpu_gemm.store(gemm); }
std::string SetCpuIsa(const std::string& name) {
  if (name == "auto") {
    kernels::cpu::SetOrderedGemmCopy(std::nullopt);
    return "";
  }
  const auto copy = kernels::cpu::OrderedGemmCopyByName(name);
  if (!copy) return "no such copy of the FP8 GEMM (auto, avx512bf16, avx512, avx2, baseline)";
  try {
    kernels::cpu::SetOrderedGemmCopy(*copy);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
CpuGemm GetCpuGemm() { return g_cpu_gemm.load(std::memory_order_relaxed); }

BackendPtr MakeCpuBackend() {
  static const BackendPtr cpu = [] {
    // BLAS single-threaded under the pool unless SetCpuThreads says otherwise.
    if (kernels::cpu::GetGemmThreads() == kernels::cpu::GemmThreads::kPool) {
      kernels::cpu::SetGemmThreads(kernels::cpu::GemmThreads::kPool);
    }
    return std::make_shared<CpuBackend>();
  }();
  return cpu;
}

}  // namespace gradwire::device
