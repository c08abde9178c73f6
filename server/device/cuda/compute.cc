// The CUDA backend's compute (cuda_backend.h): casts and the fused LayerNorm and activation casts,
// LayerNorm, activations, cuBLASLt FP8 GEMMs, reductions and the delayed-scaling roll, all on the
// compute stream, their host values read back behind them.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"
#include "check.h"
#include "gradwire/kernels/cuda/activation.h"
#include "gradwire/kernels/cuda/layernorm.h"
#include "gradwire/kernels/cuda/recipe.h"
#include "server/common/status_macros.h"
#include "server/device/cuda/cuda_backend.h"

namespace gradwire::device::cuda_backend {

absl::StatusOr<Fp8Tensor> CudaBackend::Cast(const at::Tensor& x, const QuantizerConfig& config,
                                            CastUsage usage) const {
  Use();
  const bool bf16 = x.scalar_type() == at::kBFloat16;  // FromWireBf16's: read as it is
  GW_RETURN_IF_ERROR(CheckInput("Cast", x, /*bf16_ok=*/true));
  GW_ASSIGN_OR_RETURN(PendingCast c, BeginCast("Cast", x.size(0), x.size(1), config, usage));
  if (bf16) {
    gwc::CastTransposeBf16(static_cast<const uint16_t*>(x.data_ptr()), c.out.rows, c.out.cols, c.o,
                           kStream);
  } else {
    gwc::CastTranspose(x.data_ptr<float>(), c.out.rows, c.out.cols, c.o, kStream);
  }
  return EndCast(std::move(c));
}

bool CudaBackend::Supports(Op op) const {
  switch (op) {
    case Op::kLayerNormCast:
    case Op::kActivationCast:
    case Op::kDActivationCast:
    case Op::kFromWireBf16:
    case Op::kAbsMaxLater:
    case Op::kRollScaling:
      return true;
    default:
      return Backend::Supports(op);
  }
}

absl::StatusOr<Fp8Tensor> CudaBackend::LayerNormCast(const at::Tensor& x, const LayerNormParams& ln,
                                                     const QuantizerConfig& config, CastUsage usage,
                                                     bool keep_y, LayerNormOut* ln_out) const {
  Use();
  GW_RETURN_IF_ERROR(CheckInput("LayerNormCast", x, /*bf16_ok=*/true));
  const int64_t m = x.size(0), k = x.size(1);
  GW_ASSIGN_OR_RETURN(PendingCast c, BeginCast("LayerNormCast", m, k, config, usage));
  LayerNormOut out{keep_y ? at::empty({m, k}, Floats()) : at::Tensor(), at::empty({m}, Floats()),
                   at::empty({m}, Floats())};
  RunLayerNorm(x, ln, keep_y ? out.y.data_ptr<float>() : nullptr, &c.o, out);
  if (ln_out != nullptr) *ln_out = std::move(out);
  return EndCast(std::move(c));
}

// LayerNorm's kernels on a float32 or (read as it is, widened in the kernel) bfloat16 x.
void CudaBackend::RunLayerNorm(const at::Tensor& x, const LayerNormParams& ln, float* y,
                               const gwc::Fp8Output* o, LayerNormOut& out) const {
  const int64_t m = x.size(0), k = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    gwc::LayerNormForwardBf16(static_cast<const uint16_t*>(x.data_ptr()), m, k,
                              ln.gamma.data_ptr<float>(), ln.beta.data_ptr<float>(), ln.eps,
                              ln.zero_centered_gamma, y, o, out.mu.data_ptr<float>(),
                              out.rstd.data_ptr<float>(), kStream);
  } else {
    gwc::LayerNormForward(x.data_ptr<float>(), m, k, ln.gamma.data_ptr<float>(),
                          ln.beta.data_ptr<float>(), ln.eps, ln.zero_centered_gamma, y, o,
                          out.mu.data_ptr<float>(), out.rstd.data_ptr<float>(), kStream);
  }
}

absl::StatusOr<Fp8Tensor> CudaBackend::ActivationCast(kernels::Activation act, const at::Tensor& in,
                                                      int64_t width, const QuantizerConfig& config,
                                                      CastUsage usage, at::Tensor* y) const {
  Use();
  GW_RETURN_IF_ERROR(CheckInput("ActivationCast", in));
  GW_ASSIGN_OR_RETURN(PendingCast c, BeginCast("ActivationCast", in.size(0), width, config, usage));
  at::Tensor out = y != nullptr ? at::empty({in.size(0), width}, Floats()) : at::Tensor();
  gwc::ActivationForward(act, in.data_ptr<float>(), in.size(0), width,
                         y != nullptr ? out.data_ptr<float>() : nullptr, &c.o, kStream);
  if (y != nullptr) *y = std::move(out);
  return EndCast(std::move(c));
}

absl::StatusOr<Fp8Tensor> CudaBackend::DActivationCast(kernels::Activation act,
                                                       const at::Tensor& dout, const at::Tensor& in,
                                                       int64_t width, const QuantizerConfig& config,
                                                       CastUsage usage, at::Tensor* din) const {
  Use();
  GW_RETURN_IF_ERROR(CheckInput("DActivationCast", dout));
  GW_RETURN_IF_ERROR(CheckInput("DActivationCast", in));
  GW_ASSIGN_OR_RETURN(PendingCast c,
                      BeginCast("DActivationCast", in.size(0), in.size(1), config, usage));
  at::Tensor out = din != nullptr ? at::empty_like(in) : at::Tensor();
  gwc::DActivationDbiasCast(act, dout.data_ptr<float>(), in.data_ptr<float>(), in.size(0), width,
                            din != nullptr ? out.data_ptr<float>() : nullptr, &c.o, nullptr,
                            kStream);
  if (din != nullptr) *din = std::move(out);
  return EndCast(std::move(c));
}

at::Tensor CudaBackend::Dequantize(const Fp8Tensor& t, bool rowwise) const {
  Use();
  const at::Tensor& codes = rowwise ? t.rowwise : t.columnwise;
  at::Tensor out = at::empty(codes.sizes(), Floats());
  gwc::Dequantize(codes.data_ptr<uint8_t>(), codes.numel(), t.format, ScaleInv(t),
                  out.data_ptr<float>(), kStream);
  return out;
}

LayerNormOut CudaBackend::LayerNormForward(const at::Tensor& x, const LayerNormParams& ln) const {
  Use();
  if (auto s = CheckInput("LayerNormForward", x, /*bf16_ok=*/true); !s.ok()) {
    throw std::logic_error(std::string(s.message()));
  }
  const int64_t m = x.size(0), k = x.size(1);
  LayerNormOut out{at::empty({m, k}, Floats()), at::empty({m}, Floats()), at::empty({m}, Floats())};
  RunLayerNorm(x, ln, out.y.data_ptr<float>(), nullptr, out);
  return out;
}

at::Tensor CudaBackend::LayerNormBackward(const at::Tensor& dy, const at::Tensor& x,
                                          const at::Tensor& mu, const at::Tensor& rstd,
                                          const LayerNormParams& ln, at::Tensor& gamma_grad,
                                          at::Tensor& beta_grad) const {
  Use();
  if (auto s = CheckInput("LayerNormBackward", x, /*bf16_ok=*/true); !s.ok()) {
    throw std::logic_error(std::string(s.message()));
  }
  if (auto s = CheckInput("LayerNormBackward", dy); !s.ok()) {
    throw std::logic_error(std::string(s.message()));
  }
  auto row_values = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.is_contiguous() && t.device() == device() &&
           t.numel() == x.size(0);
  };
  if (dy.sizes() != x.sizes() || !row_values(mu) || !row_values(rstd)) {
    throw std::logic_error(
        "CudaBackend::LayerNormBackward expects dy shaped as x and mu, rstd as one contiguous "
        "float32 per row on the device");
  }
  at::Tensor dx = at::empty({x.size(0), x.size(1)}, Floats());
  if (x.scalar_type() == at::kBFloat16) {
    gwc::LayerNormBackwardBf16(dy.data_ptr<float>(), static_cast<const uint16_t*>(x.data_ptr()),
                               mu.data_ptr<float>(), rstd.data_ptr<float>(),
                               ln.gamma.data_ptr<float>(), x.size(0), x.size(1),
                               ln.zero_centered_gamma, dx.data_ptr<float>(),
                               gamma_grad.data_ptr<float>(), beta_grad.data_ptr<float>(), kStream);
  } else {
    gwc::LayerNormBackward(dy.data_ptr<float>(), x.data_ptr<float>(), mu.data_ptr<float>(),
                           rstd.data_ptr<float>(), ln.gamma.data_ptr<float>(), x.size(0), x.size(1),
                           ln.zero_centered_gamma, dx.data_ptr<float>(),
                           gamma_grad.data_ptr<float>(), beta_grad.data_ptr<float>(), kStream);
  }
  return dx;
}

at::Tensor CudaBackend::ActivationForward(kernels::Activation act, const at::Tensor& in,
                                          int64_t width) const {
  Use();
  at::Tensor out = at::empty({in.size(0), width}, Floats());
  gwc::ActivationForward(act, in.data_ptr<float>(), in.size(0), width, out.data_ptr<float>(),
                         nullptr, kStream);
  return out;
}

at::Tensor CudaBackend::ActivationBackward(kernels::Activation act, const at::Tensor& dout,
                                           const at::Tensor& in, int64_t width) const {
  Use();
  at::Tensor din = at::empty_like(in);
  gwc::DActivationDbiasCast(act, dout.data_ptr<float>(), in.data_ptr<float>(), in.size(0), width,
                            din.data_ptr<float>(), nullptr, nullptr, kStream);
  return din;
}

at::Tensor CudaBackend::Fprop(const Fp8Tensor& x, const Fp8Tensor& w,
                              const at::Tensor& bias) const {
  Use();
  at::Tensor y = at::empty({x.rows, w.rows}, Floats());
  Gemm(x.rowwise, x, w.rowwise, w, x.rows, w.rows, x.cols, y, false, gwc::GemmAccumulation::kFast);
  // The bias in fp32 after the GEMM, as the reference adds it: cuBLASLt's FP8 bias epilogue
  // takes only a bf16 bias (docs/cuda.md), which would round it.
  if (bias.defined()) y.add_(bias);
  return y;
}

at::Tensor CudaBackend::Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) const {
  Use();
  at::Tensor dx = at::empty({dy.rows, w.cols}, Floats());
  Gemm(dy.rowwise, dy, w.columnwise, w, dy.rows, w.cols, dy.cols, dx, false,
       gwc::GemmAccumulation::kSplit);
  return dx;
}

void CudaBackend::Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc,
                        bool accumulate) const {
  Use();
  Gemm(dy.columnwise, dy, x.columnwise, x, dy.cols, x.cols, dy.rows, acc, accumulate,
       gwc::GemmAccumulation::kSplit);
}

void CudaBackend::AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) const {
  Use();
  // A bf16 gradient is widened first (exact), so its sum is the fp32 path's, bit for bit.
  acc.add_((g.scalar_type() == at::kFloat ? g : g.to(at::kFloat)).sum(0));
}

// Through libtorch's reductions, which keep NaN; each reads its result back to the host (a
// synchronisation): the GPU fast path moves these checks onto the device.
float CudaBackend::AbsMax(const at::Tensor& x) const {
  Use();
  if (x.numel() == 0) return 0.0f;
  const uint64_t covered = waits_->Before();
  const float amax = x.abs().max().item<float>();  // waits for the reduction
  waits_->Waited(covered);
  return amax;
}

float CudaBackend::AddAbsMax(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) const {
  Use();
  at::add_out(out, a, b);
  return AbsMax(out);
}

// The reduction, then its copy into pinned memory, queued behind it as a cast's scalars are.
CastScalars CudaBackend::AbsMaxLater(const at::Tensor& x) const {
  Use();
  if (x.numel() == 0) return CastScalars(1.0f, 1.0f, 0.0f);
  return ReadBackLater(x.abs().max().reshape({1}), [](const float* v) {
    return std::array<float, 3>{1.0f, 1.0f, v[0]};
  });
}

// The roll on the device (cuda::DelayedScalingRoll, one launch): this step's amaxes and which
// roles step cross as one small copy from pinned memory, queued without a wait. Histories
// longer than the kernel's limit roll through the host default (a copy out and back).
void CudaBackend::RollScaling(ScalingTensors& s, const std::vector<int64_t>& roles,
                              const std::vector<float>& amaxes, kernels::Fp8Format format,
                              const RecipeConfig& config) const {
  Use();
  const int64_t n = s.history.size(0), len = s.history.size(1);
  if (len != std::max<int64_t>(1, config.history_len)) {
    throw std::logic_error("CudaBackend::RollScaling: the history is not the recipe's length");
  }
  if (len > kMaxDeviceHistory || roles.size() != amaxes.size()) {
    Backend::RollScaling(s, roles, amaxes, format, config);
    return;
  }
  if (s.history.device() != device() || s.scale.device() != device() ||
      s.scale_inv.device() != device() || s.scale.numel() != n || s.scale_inv.numel() != n) {
    throw std::logic_error("CudaBackend::RollScaling: the state is not [n] tensors on " +
                           device().str());
  }
  // [pending amax: n floats | recorded: n bytes], in pinned memory crossing with libtorch's
  // non-blocking copy (queued, no wait; the pinned block is not reused before it has run).
  const int64_t words = Up16(n * 5) / 4;
  at::Tensor host = at::zeros({words}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
  auto* bytes = static_cast<uint8_t*>(host.data_ptr());
  for (size_t i = 0; i < roles.size(); ++i) {
    if (roles[i] < 0 || roles[i] >= n) {
      throw std::logic_error("CudaBackend::RollScaling: role out of range");
    }
    std::memcpy(bytes + size_t(roles[i]) * 4, &amaxes[i], 4);
    bytes[size_t(n * 4 + roles[i])] = 1;
  }
  at::Tensor step = at::empty({words}, Floats());
  step.copy_(host, /*non_blocking=*/true);
  const uint8_t* step_bytes = static_cast<const uint8_t*>(step.data_ptr());
  gwc::DelayedScalingRoll(
      s.history.data_ptr<float>(), step.data_ptr<float>(), step_bytes + n * 4, n, len, format,
      config.margin,
      config.algo == AmaxAlgo::kMax ? gwc::AmaxAlgo::kMax : gwc::AmaxAlgo::kMostRecent,
      s.scale.data_ptr<float>(), s.scale_inv.data_ptr<float>(), kStream);
}

// A contiguous 2-D float32 (or, with bf16_ok, bfloat16) tensor on this device, or why not.
absl::Status CudaBackend::CheckInput(const char* what, const at::Tensor& x, bool bf16_ok) const {
  const bool type_ok =
      x.scalar_type() == at::kFloat || (bf16_ok && x.scalar_type() == at::kBFloat16);
  if (x.dim() != 2 || !type_ok || !x.is_contiguous() || x.device() != device()) {
    return absl::InternalError(absl::StrCat("CudaBackend::", what, " expects a contiguous 2-D ",
                                            bf16_ok ? "float32 or bfloat16" : "float32",
                                            " tensor on ", device().str()));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaBackend::PendingCast> CudaBackend::BeginCast(const char* what, int64_t rows,
                                                                int64_t cols,
                                                                const QuantizerConfig& config,
                                                                CastUsage usage) const {
  // No block-scaled cast here yet: modules of those recipes are refused on this backend when
  // they are created (NewModule), so only a direct call meets this.
  if (config.block_scaled) {
    return absl::UnimplementedError(absl::StrCat(
        "CudaBackend::", what, ": the block-scaled recipes (BLOCK, MXFP8) have no CUDA path yet"));
  }
  if (!usage.rowwise && !usage.columnwise) {
    return absl::InternalError(
        absl::StrCat("CudaBackend::", what, " asked for neither rowwise nor columnwise data"));
  }
  PendingCast c;
  c.out.format = config.format;
  c.out.rows = rows;
  c.out.cols = cols;
  if (usage.rowwise) c.out.rowwise = at::empty({rows, cols}, Bytes());
  if (usage.columnwise) c.out.columnwise = at::empty({cols, rows}, Bytes());
  c.scalars = at::empty({12}, Floats());
  float* s = c.scalars.data_ptr<float>();
  c.o.format = config.format;
  c.o.scale = s;
  c.o.scale_inv = s + 4;
  c.o.amax = s + 8;
  c.o.current = !GivenScale(config);
  c.o.margin = config.margin;
  c.o.data = usage.rowwise ? c.out.rowwise.data_ptr<uint8_t>() : nullptr;
  c.o.data_t = usage.columnwise ? c.out.columnwise.data_ptr<uint8_t>() : nullptr;
  if (config.scale_device.defined() && !config.scale_of.has_value()) {
    // The module's scaling state on this device: copied in stream order, never via the host.
    const at::Tensor& given = config.scale_device;
    if (given.device() != device() || given.scalar_type() != at::kFloat || given.numel() != 1) {
      return absl::InternalError(absl::StrCat("CudaBackend::", what,
                                              " was given a scale that is not one fp32 value on ",
                                              device().str()));
    }
    GRADWIRE_CUDA_CHECK(cudaMemcpyAsync(s, given.data_ptr<float>(), sizeof(float),
                                        cudaMemcpyDeviceToDevice, kStream));
  } else if (!c.o.current) {
    // A host value (a replay's, or a given one): pageable host to device, which the driver copies
    // out before the call returns, so `given` may go away (no synchronisation).
    const float given = config.scale_of.has_value() ? config.scale_of->scale() : config.scale;
    GRADWIRE_CUDA_CHECK(cudaMemcpyAsync(s, &given, sizeof(float), cudaMemcpyHostToDevice, kStream));
  }
  return c;
}

// After the kernel: scale_inv stays on the device for the GEMMs, and scale, scale_inv and amax
// cross to pinned host memory behind the kernel, in stream order, without a wait (libtorch's
// non-blocking copy, which keeps the pinned block from reuse until it has run). The host
// reads them when first asked for (CastScalars), waiting then only if the copy is not known
// to have run (StreamWaits).
Fp8Tensor CudaBackend::EndCast(PendingCast c) const {
  c.out.scalars = ReadBackLater(c.scalars, [](const float* v) {
    return std::array<float, 3>{v[0], v[4], v[8]};
  });
  c.out.scale_inv_device = c.scalars.narrow(0, 4, 1);
  return std::move(c.out);
}

// fp32 values on this device copied into pinned memory behind everything queued so far, and a
// reader that waits for that copy (unless a wait since has covered it) and picks scale,
// scale_inv and amax from them.
CastScalars CudaBackend::ReadBackLater(const at::Tensor& device_values,
                                       std::array<float, 3> (*pick)(const float*)) const {
  at::Tensor host =
      at::empty(device_values.sizes(), at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
  host.copy_(device_values, /*non_blocking=*/true);
  const uint64_t mark = waits_->Queued();
  return CastScalars([host, mark, pick, waits = waits_, device = device_] {
    waits->WaitFor(mark, device);
    return pick(host.data_ptr<float>());
  });
}

const float* CudaBackend::ScaleInv(const Fp8Tensor& t) {
  if (!t.scale_inv_device.defined()) {
    throw std::logic_error("CudaBackend: an FP8 tensor without its device scale_inv");
  }
  return t.scale_inv_device.data_ptr<float>();
}

// codes [r, c] padded with zero codes (+0 in both formats) to [rows, cols], or itself.
at::Tensor CudaBackend::Pad(const at::Tensor& codes, int64_t rows, int64_t cols) const {
  const int64_t r = codes.size(0), c = codes.size(1);
  if (r == rows && c == cols) return codes;
  at::Tensor out = at::zeros({rows, cols}, Bytes());
  GRADWIRE_CUDA_CHECK(cudaMemcpy2DAsync(out.data_ptr<uint8_t>(), size_t(cols),
                                        codes.data_ptr<uint8_t>(), size_t(c), size_t(c), size_t(r),
                                        cudaMemcpyDeviceToDevice, kStream));
  return out;
}

// d[m, n] (=|+=) scale_inv_a scale_inv_b a[m, k] . b[n, k]^T on cuBLASLt. FP8 tensor cores take
// multiples of 16 in m, n and k: other shapes run zero-padded (zero codes add nothing) and the
// [m, n] corner is copied out.
void CudaBackend::Gemm(const at::Tensor& a, const Fp8Tensor& as, const at::Tensor& b,
                       const Fp8Tensor& bs, int64_t m, int64_t n, int64_t k, at::Tensor& d,
                       bool accumulate, gwc::GemmAccumulation accumulation) const {
  if (!a.defined() || !b.defined()) {
    throw std::logic_error("CudaBackend::Gemm: an operand's codes are missing");
  }
  if (as.format == kernels::Fp8Format::kE5M2 && bs.format == kernels::Fp8Format::kE5M2) {
    if (a.size(0) != m || a.size(1) != k || b.size(0) != n || b.size(1) != k || d.size(0) != m ||
        d.size(1) != n) {
      throw std::logic_error("CudaBackend::Gemm: E5M2 x E5M2 operands do not match m, n, k");
    }
    (void)ScaleInv(as);  // both scale_inv on the device, as every GEMM needs
    (void)ScaleInv(bs);
    GemmBothE5m2(a, as, b, bs, d, accumulate);
    return;
  }
  const int64_t M = Up16(m), N = Up16(n), K = Up16(k);
  const at::Tensor pa = Pad(a, M, K), pb = Pad(b, N, K);
  const bool padded_out = M != m || N != n;
  at::Tensor out = d;
  if (padded_out) {
    out = accumulate ? at::zeros({M, N}, Floats()) : at::empty({M, N}, Floats());
    if (accumulate) Copy2D(d, n, out, N, m, n);
  }
  gwc::LtGemmArgs g;
  g.a = pa.data_ptr<uint8_t>();
  g.a_format = as.format;
  g.a_scale_inv = ScaleInv(as);
  g.b = pb.data_ptr<uint8_t>();
  g.b_format = bs.format;
  g.b_scale_inv = ScaleInv(bs);
  g.m = M;
  g.n = N;
  g.k = K;
  g.d = out.data_ptr<float>();
  g.d_type = gwc::GemmOut::kFloat32;
  g.accumulate = accumulate;
  g.accumulation = accumulation;
  g.stream = kStream;
  gwc::Fp8GemmLt(g);
  if (padded_out) Copy2D(out, N, d, n, m, n);
}

// E5M2 x E5M2 (a wgrad of E5M2 gradient codes and an input that came as E5M2 codes): the FP8
// tensor cores need one E4M3 operand, and E5M2 does not fit E4M3 exactly. Both operands are
// decoded without their scales (exact in fp32), multiplied in float64 and scaled once: a rare
// path, slower but more exact than the FP8 GEMM it stands in for.
void CudaBackend::GemmBothE5m2(const at::Tensor& a, const Fp8Tensor& as, const at::Tensor& b,
                               const Fp8Tensor& bs, at::Tensor& d, bool accumulate) const {
  const at::Tensor one = at::ones({4}, Floats());
  auto decode = [&](const at::Tensor& codes) {
    at::Tensor out = at::empty(codes.sizes(), Floats());
    gwc::Dequantize(codes.data_ptr<uint8_t>(), codes.numel(), kernels::Fp8Format::kE5M2,
                    one.data_ptr<float>(), out.data_ptr<float>(), kStream);
    return out.to(at::kDouble);
  };
  const at::Tensor scale =
      as.scale_inv_device.to(at::kDouble) * bs.scale_inv_device.to(at::kDouble);
  const at::Tensor prod = (at::mm(decode(a), decode(b).t()) * scale).to(at::kFloat);
  if (accumulate) {
    d.add_(prod);
  } else {
    d.copy_(prod);
  }
}

// The [rows, cols] corner of fp32 `from` (row pitch from_ld elements) into `to` (pitch to_ld).
void CudaBackend::Copy2D(const at::Tensor& from, int64_t from_ld, at::Tensor& to, int64_t to_ld,
                         int64_t rows, int64_t cols) {
  GRADWIRE_CUDA_CHECK(cudaMemcpy2DAsync(
      to.data_ptr<float>(), size_t(to_ld) * 4, from.data_ptr<float>(), size_t(from_ld) * 4,
      size_t(cols) * 4, size_t(rows), cudaMemcpyDeviceToDevice, kStream));
}

}  // namespace gradwire::device::cuda_backend
