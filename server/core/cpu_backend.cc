// The CPU backend, what --device cpu runs: kernels/cpu's threaded, vectorised casts, LayerNorm,
// activations, accumulations and wire conversions (the reference's bits), and the GEMMs on the
// process's BLAS (OpenBLAS on Debian) over the decoded FP8 operands, split over the same pool.
// FP8 x FP8 products are exact in fp32, so only the accumulation order differs from the
// reference (reference_backend.cc), within the fp32 accumulation bound. It derives from the
// reference backend for what it does not replace (host tensors in and out, the dequantize).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "gradwire/kernels/cpu/blas.h"
#include "gradwire/kernels/cpu/cast.h"
#include "gradwire/kernels/cpu/layernorm.h"
#include "gradwire/kernels/cpu/loops.h"
#include "gradwire/kernels/cpu/ordered_gemm.h"
#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/cpu/scratch.h"
#include "gradwire/kernels/ref/cast.h"
#include "server/core/backend.h"
#include "server/core/cpu_gemm.h"
#include "server/core/reference_backend.h"
#include "server/core/reference_ops.h"

namespace gradwire::core {
namespace {

// The decoded floats (codes without the scale, in storage order) of one stored copy: the copy a
// workspace weight carries, else a scratch lease decoded now.
struct Decoded {
  const float* data = nullptr;
  kernels::cpu::Scratch lease;
};

Decoded Decode(const at::Tensor& codes, const std::shared_ptr<const std::vector<float>>& cached,
               kernels::Fp8Format format) {
  Decoded d;
  if (cached && int64_t(cached->size()) == codes.numel()) {
    d.data = cached->data();  // the caller's Fp8Tensor keeps it alive for the call
    return d;
  }
  d.lease = kernels::cpu::TakeScratch(size_t(codes.numel()) * sizeof(float));
  kernels::cpu::DecodeCodes(codes.data_ptr<uint8_t>(), codes.numel(), format, d.lease.floats());
  d.data = d.lease.floats();
  return d;
}

Decoded DecodeRowwise(const Fp8Tensor& t) { return Decode(t.rowwise, t.rowwise_decoded, t.format); }
Decoded DecodeColumnwise(const Fp8Tensor& t) {
  return Decode(t.columnwise, t.columnwise_decoded, t.format);
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

std::atomic<CpuGemm> g_cpu_gemm{CpuGemm::kBlas};

// C[m, n] = (A[m, k] . B[n, k]^T) * scale (+ bias) on the row-invariant GEMM (cpu_gemm.h); with
// row_scale, row i takes row_scale[i] instead of scale.
void Ordered(int64_t m, int64_t n, int64_t k, float scale, const float* a, const float* b,
             const float* bias, float* c, const float* row_scale = nullptr) {
  kernels::cpu::OrderedGemmArgs g;
  g.row_scale = row_scale;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a;
  g.lda = k;
  g.b = b;
  g.ldb = k;
  g.scale = scale;
  g.bias = bias;
  g.c = c;
  g.ldc = n;
  kernels::cpu::OrderedGemm(g);
}

// out[cols, rows] = in[rows, cols]^T, in tiles that stay in cache.
void Transpose(const float* in, int64_t rows, int64_t cols, float* out) {
  constexpr int64_t kTile = 32;
  kernels::cpu::ParallelFor((rows + kTile - 1) / kTile, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t r0 = t0 * kTile; r0 < std::min(rows, t1 * kTile); r0 += kTile) {
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        for (int64_t r = r0; r < std::min(rows, r0 + kTile); ++r) {
          for (int64_t c = c0; c < std::min(cols, c0 + kTile); ++c)
            out[c * rows + r] = in[r * cols + c];
        }
      }
    }
  });
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

  std::string Describe() const override {
    const bool pool = kernels::cpu::GetGemmThreads() == kernels::cpu::GemmThreads::kPool;
    return "host CPU, FP8 casts and loops on " + std::to_string(kernels::cpu::Threads()) +
           " threads, GEMMs on " + kernels::cpu::BlasDescription() +
           (pool ? " (split over the same threads)" : " (its own threads)") +
           (GetCpuGemm() == CpuGemm::kOrdered
                ? "; forward and input-gradient GEMMs row-invariant (" +
                      std::string(
                          kernels::cpu::OrderedGemmCopyName(kernels::cpu::OrderedGemmBestCopy())) +
                      ")"
                : "");
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
    {
      kernels::cpu::Scratch values = kernels::cpu::TakeScratch(size_t(rows * cols) * 4);
      kernels::cpu::DecodeCodes(host_codes, rows * cols, format, values.floats());
      out.scalars = CastScalars(1.0f / scale_inv, scale_inv,
                                kernels::cpu::AbsMax(values.floats(), rows * cols) * scale_inv);
    }
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

  void PrepareWeight(Fp8Tensor& w) const override {
    auto decode = [&](const at::Tensor& codes) -> std::shared_ptr<const std::vector<float>> {
      if (!codes.defined()) return nullptr;
      auto out = std::make_shared<std::vector<float>>(size_t(codes.numel()));
      kernels::cpu::DecodeCodes(codes.data_ptr<uint8_t>(), codes.numel(), w.format, out->data());
      return out;
    };
    w.rowwise_decoded = decode(w.rowwise);
    w.columnwise_decoded = decode(w.columnwise);
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

  // y = (x . w^T) * (scale_inv_x * scale_inv_w) (+ bias): the bias is the sum's first term.
  at::Tensor Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias) const override {
    GemmTimer timer(2.0 * double(x.rows) * double(w.rows) * double(x.cols));
    const Decoded a = DecodeRowwise(x), b = DecodeRowwise(w);
    at::Tensor y = Empty({x.rows, w.rows});
    if (GetCpuGemm() == CpuGemm::kOrdered) {  // the reference's arithmetic: bias added last
      Ordered(x.rows, w.rows, x.cols, x.scale_inv() * w.scale_inv(), a.data, b.data,
              bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>());
      return y;
    }
    if (bias.defined()) {
      kernels::cpu::FillRows(bias.data_ptr<float>(), x.rows, w.rows, y.data_ptr<float>());
    }
    Gemm(false, true, x.rows, w.rows, x.cols, x.scale_inv() * w.scale_inv(), a.data, b.data,
         bias.defined() ? 1.0f : 0.0f, y.data_ptr<float>());
    return y;
  }
  // A batch's rows in one GEMM when the GEMM is the row-invariant one: each group's codes decoded
  // into its rows of one operand, each row scaled by its group's scale_inv. Row-invariance makes
  // every row the bits of its group's Fprop alone; BLAS is not row-invariant, so under it each
  // group runs its own Fprop (the default).
  at::Tensor FpropGroups(const Fp8Tensor& x, const Fp8Tensor& w,
                         const at::Tensor& bias) const override {
    if (GetCpuGemm() != CpuGemm::kOrdered) return Backend::FpropGroups(x, w, bias);
    GemmTimer timer(2.0 * double(x.rows) * double(w.rows) * double(x.cols));
    const Decoded b = DecodeRowwise(w);
    const GroupedRows a = DecodeGroups(x, w.scale_inv());
    at::Tensor y = Empty({x.rows, w.rows});
    Ordered(x.rows, w.rows, x.cols, 1.0f, a.codes.floats(), b.data,
            bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(),
            a.row_scale.data());
    return y;
  }
  // The A operand of a batch's ordered GEMM: each group's codes decoded into its rows of one
  // scratch operand, and each row's scale (its group's scale_inv x the other operand's), which
  // is the scalar the group's own GEMM would use.
  struct GroupedRows {
    kernels::cpu::Scratch codes;
    std::vector<float> row_scale;
  };
  static GroupedRows DecodeGroups(const Fp8Tensor& x, float other_scale_inv) {
    GroupedRows out;
    out.codes = kernels::cpu::TakeScratch(size_t(x.rows * x.cols) * sizeof(float));
    out.row_scale.reserve(size_t(x.rows));
    int64_t row = 0;
    for (const Fp8Tensor& g : x.groups) {
      kernels::cpu::DecodeCodes(g.rowwise.data_ptr<uint8_t>(), g.rows * g.cols, g.format,
                                out.codes.floats() + row * x.cols);
      out.row_scale.insert(out.row_scale.end(), size_t(g.rows), g.scale_inv() * other_scale_inv);
      row += g.rows;
    }
    return out;
  }
  // What the ordered GEMM reads as B for a dgrad: W^T [K, N], the columnwise copy, else W's rows
  // transposed into scratch.
  static Decoded OrderedDgradOperand(const Fp8Tensor& w) {
    Decoded bt;
    if (w.has_columnwise()) return DecodeColumnwise(w);
    Decoded rows;
    if (!w.has_rowwise() && w.rowwise_decoded &&
        int64_t(w.rowwise_decoded->size()) == w.rows * w.cols) {
      rows.data = w.rowwise_decoded->data();
    } else {
      rows = DecodeRowwise(w);
    }
    bt.lease = kernels::cpu::TakeScratch(size_t(w.rows * w.cols) * sizeof(float));
    Transpose(rows.data, w.rows, w.cols, bt.lease.floats());
    bt.data = bt.lease.floats();
    return bt;
  }
  at::Tensor Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) const override {
    GemmTimer timer(2.0 * double(dy.rows) * double(w.cols) * double(dy.cols));
    const Decoded a = DecodeRowwise(dy);
    at::Tensor dx = Empty({dy.rows, w.cols});
    if (GetCpuGemm() == CpuGemm::kOrdered) {
      const Decoded bt = OrderedDgradOperand(w);
      Ordered(dy.rows, w.cols, dy.cols, dy.scale_inv() * w.scale_inv(), a.data, bt.data, nullptr,
              dx.data_ptr<float>());
      return dx;
    }
    // W [N, K] rowwise: from its codes, or from the decoded copy a pinned backward weight still
    // reaches while its version is cached; else W^T [K, N], a transposed operand (slower to
    // pack for BLAS).
    Decoded b;
    bool rowwise = true;
    if (w.has_rowwise()) {
      b = DecodeRowwise(w);
    } else if (w.rowwise_decoded && int64_t(w.rowwise_decoded->size()) == w.rows * w.cols) {
      b.data = w.rowwise_decoded->data();
    } else {
      b = DecodeColumnwise(w);
      rowwise = false;
    }
    Gemm(false, !rowwise, dy.rows, w.cols, dy.cols, dy.scale_inv() * w.scale_inv(), a.data, b.data,
         0.0f, dx.data_ptr<float>());
    return dx;
  }
  // A batch of backwards in one dgrad GEMM under the row-invariant GEMM, as FpropGroups does.
  at::Tensor DgradGroups(const Fp8Tensor& dy, const Fp8Tensor& w) const override {
    if (GetCpuGemm() != CpuGemm::kOrdered) return Backend::DgradGroups(dy, w);
    GemmTimer timer(2.0 * double(dy.rows) * double(w.cols) * double(dy.cols));
    const Decoded bt = OrderedDgradOperand(w);
    const GroupedRows a = DecodeGroups(dy, w.scale_inv());
    at::Tensor dx = Empty({dy.rows, w.cols});
    Ordered(dy.rows, w.cols, dy.cols, 1.0f, a.codes.floats(), bt.data, nullptr,
            dx.data_ptr<float>(), a.row_scale.data());
    return dx;
  }
  void Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc,
             bool accumulate) const override {
    GemmTimer timer(2.0 * double(dy.cols) * double(x.cols) * double(dy.rows));
    const Decoded a = DecodeColumnwise(dy), b = DecodeColumnwise(x);  // dY^T [N, M], X^T [K, M]
    Gemm(false, true, dy.cols, x.cols, dy.rows, dy.scale_inv() * x.scale_inv(), a.data, b.data,
         accumulate ? 1.0f : 0.0f, acc.data_ptr<float>());
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

}  // namespace gradwire::core
