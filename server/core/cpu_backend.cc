// The host backends.
//
//   ReferenceBackend  the reference kernels (kernels/ref) on host tensors, single-threaded: the
//                     definition of the numerics every other backend is checked against
//                     (tests/core/backend_parity_test.cc).
//   CpuBackend        what --device cpu runs: the reference's casts, LayerNorm and activations,
//                     and the GEMMs through libtorch's BLAS (OpenBLAS where installed) on the
//                     decoded FP8 operands, multi-threaded. FP8 x FP8 products are exact in
//                     fp32, so only the accumulation order differs from the reference, within
//                     the fp32 accumulation bound.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "gradwire/kernels/ref/activation.h"
#include "gradwire/kernels/ref/cast.h"
#include "server/core/backend.h"
#include "server/core/fp8_ops.h"
#include "server/core/layernorm_linear.h"

namespace gradwire::core {
namespace {

class ReferenceBackend : public Backend {
 public:
  const char* name() const override { return "reference"; }
  at::Device device() const override { return at::kCPU; }
  std::string Describe() const override {
    return "host CPU, reference FP8 kernels (single-threaded)";
  }

  at::Tensor ToDevice(const at::Tensor& t) const override {
    return t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  }
  at::Tensor ToHost(const at::Tensor& t) const override { return ToDevice(t); }

  absl::StatusOr<Fp8Tensor> Cast(const at::Tensor& x, const QuantizerConfig& config,
                                 CastUsage usage) const override {
    return Quantize(x, config, usage);
  }
  Fp8Tensor FromCodes(const uint8_t* host_codes, int64_t rows, int64_t cols,
                      kernels::Fp8Format format, float scale_inv, CastUsage usage) const override {
    return core::FromCodes(host_codes, rows, cols, format, scale_inv, usage);
  }
  at::Tensor Dequantize(const Fp8Tensor& t, bool rowwise) const override {
    return core::Dequantize(t, rowwise);
  }
  void PrepareWeight(Fp8Tensor& w) const override { AttachDecodedCopies(w); }

  at::Tensor FromWire(const wire::TensorView& v, int64_t rows, int64_t cols, Fp8Tensor* codes,
                      CastUsage usage) const override {
    if (wire::IsFp8(v.dtype) && codes != nullptr) {
      *codes = core::FromCodes(
          static_cast<const uint8_t*>(v.data), rows, cols,
          v.dtype == wire::DType::kFp8E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2,
          v.scale_inv, usage);
    }
    if (v.dtype == wire::DType::kF32 && reinterpret_cast<uintptr_t>(v.data) % alignof(float) == 0) {
      // Borrow the request's bytes: no copy on the hot path.
      return at::from_blob(const_cast<void*>(v.data), {rows, cols}, Float32());
    }
    at::Tensor out = at::empty({rows, cols}, Float32());
    Decode(v, out.data_ptr<float>());
    return out;
  }
  wire::EncodedTensor ToWire(const at::Tensor& x, wire::DType dtype,
                             std::vector<int64_t> shape) const override {
    const at::Tensor src = ToHost(x.to(at::kFloat));
    wire::EncodedTensor out;
    out.dtype = dtype;
    out.shape = std::move(shape);
    out.bytes.resize(size_t(src.numel() * wire::ElementSize(dtype)));
    out.scale_inv = Encode(src.data_ptr<float>(), src.numel(), dtype, out.bytes.data());
    return out;
  }

  LayerNormOut LayerNormForward(const at::Tensor& x, const LayerNormParams& ln) const override {
    return RunLayerNorm(x, ln);
  }
  at::Tensor LayerNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mu,
                               const at::Tensor& rstd, const LayerNormParams& ln,
                               at::Tensor& gamma_grad, at::Tensor& beta_grad) const override {
    return RunLayerNormBackward(dy, x, mu, rstd, ln, gamma_grad, beta_grad);
  }

  at::Tensor ActivationForward(kernels::Activation act, const at::Tensor& in,
                               int64_t width) const override {
    at::Tensor out = at::empty({in.size(0), width}, at::TensorOptions().dtype(at::kFloat));
    kernels::ActivationForward(act, in.data_ptr<float>(), in.size(0), width, out.data_ptr<float>());
    return out;
  }
  at::Tensor ActivationBackward(kernels::Activation act, const at::Tensor& dout,
                                const at::Tensor& in, int64_t width) const override {
    at::Tensor din = at::empty_like(in);
    kernels::ActivationBackward(act, dout.data_ptr<float>(), in.data_ptr<float>(), in.size(0),
                                width, din.data_ptr<float>());
    return din;
  }

  at::Tensor Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias) const override {
    return Fp8Fprop(x, w, bias);
  }
  at::Tensor Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) const override {
    return Fp8Dgrad(dy, w);
  }
  void WgradAccumulate(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc) const override {
    Fp8WgradAccumulate(dy, x, acc);
  }
  void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) const override {
    core::AccumulateBiasGrad(g, acc);
  }

  void Synchronize() const override {}

 protected:
  static at::TensorOptions Float32() { return at::TensorOptions().dtype(at::kFloat); }
  // The wire codec over a whole tensor (the CPU backend splits these over threads).
  virtual void Decode(const wire::TensorView& v, float* out) const {
    wire::DecodeElements(v.dtype, v.data, v.numel(), v.scale_inv, out);
  }
  virtual float Encode(const float* x, int64_t n, wire::DType dtype, void* out) const {
    return wire::EncodeTensor(x, n, dtype, out);
  }
};

// FP8 codes decoded to their values without the scale, as an fp32 tensor of the codes' shape:
// the decoded copy a workspace weight carries, or a fresh one.
at::Tensor DecodedCodes(const at::Tensor& codes,
                        const std::shared_ptr<const std::vector<float>>& cached,
                        kernels::Fp8Format format) {
  if (cached && int64_t(cached->size()) == codes.numel()) {
    // A view of the cached copy: the caller's Fp8Tensor keeps it alive for the call.
    return at::from_blob(const_cast<float*>(cached->data()), codes.sizes(),
                         at::TensorOptions().dtype(at::kFloat));
  }
  at::Tensor out = at::empty(codes.sizes(), at::TensorOptions().dtype(at::kFloat));
  const float* table = kernels::DecodeTable(format);
  const uint8_t* in = codes.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, codes.numel(), int64_t(1) << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = table[in[i]];
  });
  return out;
}

at::Tensor Rowwise(const Fp8Tensor& t) {
  return DecodedCodes(t.rowwise, t.rowwise_decoded, t.format);
}
at::Tensor Columnwise(const Fp8Tensor& t) {
  return DecodedCodes(t.columnwise, t.columnwise_decoded, t.format);
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

// max that keeps a NaN, as kernels::Amax does over a whole tensor.
constexpr int64_t kWireGrain = int64_t(1) << 16;  // elements per thread's slice, at least

float CombineAmax(float a, float b) {
  return std::isnan(a) ? a : std::isnan(b) ? b : std::max(a, b);
}

class CpuBackend final : public ReferenceBackend {
 public:
  const char* name() const override { return "cpu"; }

  // The reference cast, split over rows: the same element math (kernels::QuantizeFp8), the same
  // amax (a max is order-free; a NaN wins as in kernels::Amax), so the codes, scale, scale_inv
  // and amax are the reference's bit for bit (the parity harness checks it).
  absl::StatusOr<Fp8Tensor> Cast(const at::Tensor& x, const QuantizerConfig& config,
                                 CastUsage usage) const override {
    if (x.dim() != 2 || x.scalar_type() != at::kFloat || !x.is_contiguous() || !x.is_cpu() ||
        (!usage.rowwise && !usage.columnwise) || x.numel() < (int64_t(1) << 16)) {
      return ReferenceBackend::Cast(x, config, usage);  // small, or refused with its message
    }
    Fp8Tensor out;
    out.format = config.format;
    out.rows = x.size(0);
    out.cols = x.size(1);
    const int64_t rows = out.rows, cols = out.cols;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / cols);
    const float* data = x.data_ptr<float>();
    const bool delayed = config.scale > 0.0f;
    float scale = config.scale;
    if (!delayed) {
      const float amax = at::parallel_reduce(
          0, rows, grain, 0.0f,
          [&](int64_t b, int64_t e, float acc) {
            return CombineAmax(acc, kernels::Amax(data + b * cols, (e - b) * cols));
          },
          CombineAmax);
      scale = kernels::ComputeScale(amax, config.format, config.margin);
    }
    const auto bytes = at::TensorOptions().dtype(at::kByte);
    at::Tensor rowwise = at::empty({rows, cols}, bytes);  // a temporary when only columnwise
    uint8_t* rw = rowwise.data_ptr<uint8_t>();
    out.amax = at::parallel_reduce(
        0, rows, grain, 0.0f,
        [&](int64_t b, int64_t e, float acc) {
          float a = 0.0f;
          kernels::QuantizeFp8(data + b * cols, e - b, cols, scale, config.format, rw + b * cols,
                               nullptr, &a);
          return CombineAmax(acc, a);
        },
        CombineAmax);
    if (usage.columnwise) {
      out.columnwise = at::empty({cols, rows}, bytes);
      uint8_t* t = out.columnwise.data_ptr<uint8_t>();
      constexpr int64_t kTile = 64;  // tiles keep both sides of the transpose in cache
      at::parallel_for(0, (rows + kTile - 1) / kTile, 1, [&](int64_t tb, int64_t te) {
        for (int64_t r0 = tb * kTile; r0 < std::min(rows, te * kTile); r0 += kTile) {
          const int64_t r1 = std::min(rows, r0 + kTile);
          for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
            const int64_t c1 = std::min(cols, c0 + kTile);
            for (int64_t c = c0; c < c1; ++c) {
              for (int64_t r = r0; r < r1; ++r) t[c * rows + r] = rw[r * cols + c];
            }
          }
        }
      });
    }
    if (usage.rowwise) out.rowwise = std::move(rowwise);
    out.scale = scale;
    out.scale_inv = 1.0f / scale;
    return out;
  }
  // The wire codec split over threads: elementwise, so the bytes are the reference's; an FP8
  // encode takes one scale from the whole tensor's amax, as the codec does.
  void Decode(const wire::TensorView& v, float* out) const override {
    const int64_t size = wire::ElementSize(v.dtype);
    const auto* bytes = static_cast<const unsigned char*>(v.data);
    at::parallel_for(0, v.numel(), kWireGrain, [&](int64_t b, int64_t e) {
      wire::DecodeElements(v.dtype, bytes + b * size, e - b, v.scale_inv, out + b);
    });
  }
  float Encode(const float* x, int64_t n, wire::DType dtype, void* out) const override {
    float scale = 1.0f;
    if (wire::IsFp8(dtype)) {
      const float amax = at::parallel_reduce(
          0, n, kWireGrain, 0.0f,
          [&](int64_t b, int64_t e, float acc) {
            return CombineAmax(acc, wire::AbsMax(x + b, e - b));
          },
          CombineAmax);
      scale = wire::Fp8EncodeScale(dtype, amax);
    }
    const int64_t size = wire::ElementSize(dtype);
    auto* bytes = static_cast<unsigned char*>(out);
    at::parallel_for(0, n, kWireGrain, [&](int64_t b, int64_t e) {
      wire::EncodeElements(x + b, e - b, dtype, scale, bytes + b * size);
    });
    return wire::IsFp8(dtype) ? 1.0f / scale : 1.0f;
  }

  std::string Describe() const override {
    return "host CPU, FP8 casts from the reference kernels, GEMMs on BLAS (" +
           std::to_string(at::get_num_threads()) + " threads)";
  }

  // y = (x . w^T) * (scale_inv_x * scale_inv_w) (+ bias): the reference's order per element.
  at::Tensor Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias) const override {
    GemmTimer timer(2.0 * double(x.rows) * double(w.rows) * double(x.cols));
    at::Tensor y = at::mm(Rowwise(x), Rowwise(w).t());
    y.mul_(x.scale_inv * w.scale_inv);
    if (bias.defined()) y.add_(bias);
    return y;
  }
  at::Tensor Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) const override {
    GemmTimer timer(2.0 * double(dy.rows) * double(w.cols) * double(dy.cols));
    // w's columnwise copy is W^T [K, N]; a pinned backward weight may have only that.
    at::Tensor dx =
        w.has_rowwise() ? at::mm(Rowwise(dy), Rowwise(w)) : at::mm(Rowwise(dy), Columnwise(w).t());
    dx.mul_(dy.scale_inv * w.scale_inv);
    return dx;
  }
  void WgradAccumulate(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc) const override {
    GemmTimer timer(2.0 * double(dy.cols) * double(x.cols) * double(dy.rows));
    acc.addmm_(Columnwise(dy), Columnwise(x).t(), /*beta=*/1, /*alpha=*/dy.scale_inv * x.scale_inv);
  }
  void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) const override {
    acc.add_(g.sum(0));
  }
};

}  // namespace

at::Tensor Backend::Empty(at::IntArrayRef shape) const {
  return at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(device()));
}

at::Tensor Backend::Zeros(at::IntArrayRef shape) const {
  return at::zeros(shape, at::TensorOptions().dtype(at::kFloat).device(device()));
}

void SetCpuThreads(int threads) {
  const int n = threads > 0 ? threads : int(std::thread::hardware_concurrency());
  if (n > 0) at::set_num_threads(n);
}

BackendPtr MakeReferenceBackend() {
  static const BackendPtr reference = std::make_shared<ReferenceBackend>();
  return reference;
}

BackendPtr MakeCpuBackend() {
  static const BackendPtr cpu = std::make_shared<CpuBackend>();
  return cpu;
}

}  // namespace gradwire::core
