// The CUDA backend: the modules' computations on one GPU through kernels/cuda (fused casts,
// LayerNorm, activations) and cuBLASLt FP8 GEMMs, on tensors from libtorch's caching allocator.
//
// Streams: every launch goes to the device's legacy default stream (the compute stream), the
// stream libtorch's own ops (allocation bookkeeping, add_, zero_) use when nothing else is made
// current, which keeps the caching allocator's reuse of freed blocks in order with the kernels
// that read them without c10::cuda stream guards (which a CPU libtorch build does not have: this
// file must compile on a machine without CUDA libtorch). Wire tensors cross on a copy stream of
// their own (non-blocking, ordered by events: CopyLane, copy_lane.h), so that a request's input
// crosses while the compute stream still runs the previous call's work, and a result's copy back
// waits only for the compute that wrote it. Uploads land in blocks the lane holds and the compute
// stream copies them into the caller's tensor, so the copy stream never writes a block the
// allocator could still have compute work pending on.
//
// Host values: a cast leaves its scale, scale_inv and amax on the device and queues their copy
// back behind its kernel; the host reads them when a module first asks (CastScalars), and one
// stream wait then serves every cast queued before it (StreamWaits). The modules ask at the end
// of a kind's forward or backward (the step's amaxes, the finite checks, the error bounds), after
// its GEMMs are queued. The scaling state is on the device: a delayed cast copies its scale from
// there and the roll runs there (RollScaling). docs/backends.md lists what the seam does not do
// yet.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"
#include "check.h"
#include "device_query.h"
#include "gradwire/kernels/cuda/activation.h"
#include "gradwire/kernels/cuda/cast.h"
#include "gradwire/kernels/cuda/gemm_lt.h"
#include "gradwire/kernels/cuda/layernorm.h"
#include "gradwire/kernels/cuda/recipe.h"
#include "server/core/backend.h"
#include "server/core/copy_lane.h"
#include "server/core/staged_copy.h"
#include "server/core/status_macros.h"

namespace gradwire::core {
namespace {

namespace gwc = kernels::cuda;

constexpr cudaStream_t kStream = nullptr;  // the legacy default stream (see above)
// The longest amax history cuda::DelayedScalingRoll takes (it stages a row in shared memory).
constexpr int64_t kMaxDeviceHistory = 8192;

int64_t Up16(int64_t v) { return (v + 15) / 16 * 16; }

// Two pinned slots and their events for StagedCopier, the copies on the copy stream. Wire
// tensors of at least kStagedMinBytes cross through it when --cuda-staging-mib is set; smaller
// ones cost less as one plain copy.
constexpr size_t kStagedMinBytes = size_t(1) << 20;
// Uploads up to this size land in one of the lane's two landing blocks (grown to the largest
// upload so far, in MiB; held for the backend's life, so at most twice this much device memory);
// a larger one crosses straight into its tensor after the compute stream's work. 128 MiB holds
// a step tensor of 8192 x 4096 float32.
constexpr size_t kLandingMaxBytes = size_t(128) << 20;

// The copy stream and the lane's events. Made first and gone last: the staging and the lane
// queue work on them.
class CopyStream {
 public:
  CopyStream() {
    try {
      GRADWIRE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      for (cudaEvent_t& e : events_) {
        GRADWIRE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      }
    } catch (...) {
      Free();
      throw;
    }
  }
  ~CopyStream() { Free(); }
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  cudaStream_t stream() const { return stream_; }
  cudaEvent_t event(int e) const {
    if (e < 0 || e >= CopyLane::kEvents) throw std::logic_error("CopyStream: no such event");
    return events_[size_t(e)];
  }

 private:
  void Free() {
    if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamSynchronize(kStream);
    for (cudaEvent_t& e : events_) {
      if (e != nullptr) (void)cudaEventDestroy(e);
      e = nullptr;
    }
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
  std::array<cudaEvent_t, CopyLane::kEvents> events_{};
};

class PinnedStaging {
 public:
  PinnedStaging(size_t chunk, cudaStream_t stream) : stream_(stream) {
    try {
      for (size_t i = 0; i < slots_.size(); ++i) {
        GRADWIRE_CUDA_CHECK(cudaHostAlloc(&slots_[i], chunk, cudaHostAllocDefault));
        GRADWIRE_CUDA_CHECK(cudaEventCreateWithFlags(&events_[i], cudaEventDisableTiming));
      }
    } catch (...) {
      Free();
      throw;
    }
    StagingOps ops;
    ops.to_device = [this](void* device, const void* pinned, size_t n) {
      GRADWIRE_CUDA_CHECK(cudaMemcpyAsync(device, pinned, n, cudaMemcpyHostToDevice, stream_));
    };
    ops.to_host = [this](void* pinned, const void* device, size_t n) {
      GRADWIRE_CUDA_CHECK(cudaMemcpyAsync(pinned, device, n, cudaMemcpyDeviceToHost, stream_));
    };
    ops.record = [this](int slot) {
      GRADWIRE_CUDA_CHECK(cudaEventRecord(events_[size_t(slot)], stream_));
    };
    ops.wait = [this](int slot) {
      GRADWIRE_CUDA_CHECK(cudaEventSynchronize(events_[size_t(slot)]));
    };
    copier_ = std::make_unique<StagedCopier>(std::vector<void*>(slots_.begin(), slots_.end()),
                                             chunk, std::move(ops));
  }
  ~PinnedStaging() { Free(); }
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  StagedCopier& copier() { return *copier_; }

 private:
  // Nothing may still read or write the slots: wait for the stream, then free (errors ignored:
  // this runs in a destructor).
  void Free() {
    (void)cudaStreamSynchronize(stream_);
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (events_[i] != nullptr) (void)cudaEventDestroy(events_[i]);
      if (slots_[i] != nullptr) (void)cudaFreeHost(slots_[i]);
      events_[i] = nullptr;
      slots_[i] = nullptr;
    }
  }

  cudaStream_t stream_;
  std::array<void*, 2> slots_{};
  std::array<cudaEvent_t, 2> events_{};
  std::unique_ptr<StagedCopier> copier_;
};

// The host's reads of values queued to cross back behind the kernels (the casts' scalars): how
// many copies have been queued, and up to which one they are known to have run. A read waits for
// the stream only when its copy is not known done, and that one wait then covers every copy
// queued before it: the first read after a forward's kernels waits once, the others not at all.
class StreamWaits {
 public:
  // Call after queuing a copy: its mark.
  uint64_t Queued() { return queued_.fetch_add(1) + 1; }
  void WaitFor(uint64_t mark, int device) {
    if (done_.load() >= mark) return;
    const uint64_t covered = Before();
    GRADWIRE_CUDA_CHECK(cudaSetDevice(device));
    GRADWIRE_CUDA_CHECK(cudaStreamSynchronize(kStream));
    Waited(covered);
  }
  // For a wait the backend makes some other way (a synchronous copy, a read of a reduction):
  // Before() ahead of it, Waited(that) after it, which counts it and marks every copy queued
  // before it done.
  uint64_t Before() const { return queued_.load(); }
  void Waited(uint64_t covered) {
    waits_.fetch_add(1);
    uint64_t done = done_.load();
    while (done < covered && !done_.compare_exchange_weak(done, covered)) {
    }
  }
  // Waits so far (each a stream synchronisation).
  int64_t waits() const { return waits_.load(); }

 private:
  std::atomic<uint64_t> queued_{0}, done_{0};
  std::atomic<int64_t> waits_{0};
};

class CudaBackend final : public Backend {
 public:
  // own_copy_stream false: the wire copies go on the compute stream, straight into their tensors
  // (no landing): GRADWIRE_CUDA_COPY_STREAM=0, a one-stream baseline for measuring what the copy
  // stream changes. (Not quite the code before the lane: an upload there ended with a wait for
  // the stream; here it is queued, ordered by the stream alone.)
  CudaBackend(int device, std::string description, int64_t staging_chunk, bool own_copy_stream)
      : device_(device),
        description_(std::move(description)),
        copy_stream_(own_copy_stream ? copy_->stream() : kStream) {
    if (staging_chunk > 0) {
      staging_ = std::make_unique<PinnedStaging>(size_t(staging_chunk), copy_stream_);
      description_ += absl::StrCat(", pinned staging ", staging_chunk >> 20, " MiB x 2");
    }
    description_ += own_copy_stream ? ", wire copies on their own stream"
                                    : ", wire copies on the compute stream";
    lane_ = std::make_unique<CopyLane>(LaneOpsOn(), staging_ ? &staging_->copier() : nullptr,
                                       kStagedMinBytes, own_copy_stream ? kLandingMaxBytes : 0);
  }
  ~CudaBackend() override {
    // Both streams finish before the lane gives its landings back and the staging frees its slots.
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(copy_stream_);
    (void)cudaStreamSynchronize(kStream);
    lane_.reset();
    staging_.reset();
  }

  const char* name() const override { return "cuda"; }
  at::Device device() const override { return at::Device(at::kCUDA, at::DeviceIndex(device_)); }
  std::string Describe() const override { return description_ + ", CUDA FP8 backend (cuBLASLt)"; }

  at::Tensor ToDevice(const at::Tensor& t) const override {
    Use();
    return t.device() == device() ? t.contiguous() : t.to(device()).contiguous();
  }
  at::Tensor ToHost(const at::Tensor& t) const override {
    return t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  }

  absl::StatusOr<Fp8Tensor> Cast(const at::Tensor& x, const QuantizerConfig& config,
                                 CastUsage usage) const override {
    Use();
    const bool bf16 = x.scalar_type() == at::kBFloat16;  // FromWireBf16's: read as it is
    GW_RETURN_IF_ERROR(CheckInput("Cast", x, /*bf16_ok=*/true));
    GW_ASSIGN_OR_RETURN(PendingCast c, BeginCast("Cast", x.size(0), x.size(1), config, usage));
    if (bf16) {
      gwc::CastTransposeBf16(static_cast<const uint16_t*>(x.data_ptr()), c.out.rows, c.out.cols,
                             c.o, kStream);
    } else {
      gwc::CastTranspose(x.data_ptr<float>(), c.out.rows, c.out.cols, c.o, kStream);
    }
    return EndCast(std::move(c));
  }

  // The fused forms: the LayerNorm / activation / d-activation kernels write the FP8 cast of
  // their result in the same pass (under current scaling, a first pass finds the amax), and the
  // fp32 result only when asked. Each kernel computes its values with the same code whether or not
  // it casts, so the fused form equals the composed one bit for bit (FusedParity).
  bool Fuses(Fused form) const override {
    (void)form;
    return true;
  }
  absl::StatusOr<Fp8Tensor> LayerNormCast(const at::Tensor& x, const LayerNormParams& ln,
                                          const QuantizerConfig& config, CastUsage usage,
                                          bool keep_y, LayerNormOut* ln_out) const override {
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
  void RunLayerNorm(const at::Tensor& x, const LayerNormParams& ln, float* y,
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
  absl::StatusOr<Fp8Tensor> ActivationCast(kernels::Activation act, const at::Tensor& in,
                                           int64_t width, const QuantizerConfig& config,
                                           CastUsage usage, at::Tensor* y) const override {
    Use();
    GW_RETURN_IF_ERROR(CheckInput("ActivationCast", in));
    GW_ASSIGN_OR_RETURN(PendingCast c,
                        BeginCast("ActivationCast", in.size(0), width, config, usage));
    at::Tensor out = y != nullptr ? at::empty({in.size(0), width}, Floats()) : at::Tensor();
    gwc::ActivationForward(act, in.data_ptr<float>(), in.size(0), width,
                           y != nullptr ? out.data_ptr<float>() : nullptr, &c.o, kStream);
    if (y != nullptr) *y = std::move(out);
    return EndCast(std::move(c));
  }
  absl::StatusOr<Fp8Tensor> DActivationCast(kernels::Activation act, const at::Tensor& dout,
                                            const at::Tensor& in, int64_t width,
                                            const QuantizerConfig& config, CastUsage usage,
                                            at::Tensor* din) const override {
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

  Fp8Tensor FromCodes(const uint8_t* host_codes, int64_t rows, int64_t cols,
                      kernels::Fp8Format format, float scale_inv, CastUsage usage) const override {
    Use();
    // The host reference makes the transpose and the amax; the codes then move as they are.
    Fp8Tensor out = core::FromCodes(host_codes, rows, cols, format, scale_inv, usage);
    if (out.has_rowwise()) out.rowwise = Upload(out.rowwise);
    if (out.has_columnwise()) out.columnwise = Upload(out.columnwise);
    // scale_inv crosses from pinned memory without a wait (the pinned block is kept until the
    // copy has run).
    at::Tensor scalars = at::empty({4}, Floats());
    const at::Tensor host =
        at::full({1}, scale_inv, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
    scalars.narrow(0, 0, 1).copy_(host, /*non_blocking=*/true);
    out.scale_inv_device = scalars.narrow(0, 0, 1);
    return out;
  }

  // A wire tensor crosses to the GPU in its own dtype: FP8 as codes (FromCodes, then decoded on
  // the device), bf16/f16 as 2-byte values widened there by libtorch (exact), f32 as it is.
  at::Tensor FromWire(const wire::TensorView& v, int64_t rows, int64_t cols, Fp8Tensor* codes,
                      CastUsage usage) const override {
    Use();
    if (wire::IsFp8(v.dtype)) {
      usage.rowwise = true;  // the decode reads the rowwise codes
      Fp8Tensor c = FromCodes(
          static_cast<const uint8_t*>(v.data), rows, cols,
          v.dtype == wire::DType::kFp8E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2,
          v.scale_inv, usage);
      at::Tensor decoded = Dequantize(c, /*rowwise=*/true);
      if (codes != nullptr) *codes = std::move(c);
      return decoded;
    }
    return Narrow(v, rows, cols).to(at::kFloat).contiguous();
  }
  // Kept in bf16 on the device: the casts read it as it is (CastTransposeBf16).
  at::Tensor FromWireBf16(const wire::TensorView& v, int64_t rows, int64_t cols) const override {
    Use();
    if (v.dtype != wire::DType::kBF16 || rows * cols != v.numel()) {
      throw std::logic_error("FromWireBf16: not a bf16 view of rows x cols");
    }
    return Narrow(v, rows, cols);
  }

  wire::EncodedTensor ToWire(const at::Tensor& x, wire::DType dtype,
                             std::vector<int64_t> shape) const override {
    Use();
    wire::EncodedTensor out;
    out.dtype = dtype;
    out.shape = std::move(shape);
    if (wire::IsFp8(dtype)) {
      QuantizerConfig q;
      q.format =
          dtype == wire::DType::kFp8E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2;
      q.margin = 0;
      q.scale = 0.0f;  // current scaling: the scale from x's own amax
      const at::Tensor x2 = x.reshape({1, x.numel()}).contiguous();
      absl::StatusOr<Fp8Tensor> cast = Cast(x2, q, {true, false});
      if (!cast.ok()) throw std::runtime_error(std::string(cast.status().message()));
      // The codes' copy waits for the compute stream up to the cast, which brings the cast's
      // scalars (and every read back queued before them) with it.
      out.bytes.resize(size_t(cast->rowwise.numel()));
      const uint64_t covered = waits_->Before();
      lane_->Download(out.bytes.data(), cast->rowwise.data_ptr(), out.bytes.size());
      if (!out.bytes.empty()) waits_->Waited(covered);
      out.scale_inv = cast->scale_inv();
      return out;
    } else {
      const at::ScalarType type = dtype == wire::DType::kF32    ? at::kFloat
                                  : dtype == wire::DType::kBF16 ? at::kBFloat16
                                                                : at::kHalf;
      // Straight into the response's bytes: no host tensor in between (a host x is copied on the
      // host).
      const at::Tensor src = x.to(type).contiguous();
      out.bytes.resize(size_t(src.numel() * wire::ElementSize(dtype)));
      // A wait for the copy back, which waits for the compute stream up to here (every read back
      // queued before it is then done too): the call's one wait when its verdicts are read after
      // it (ModuleHost's Forward and Backward). Compute queued later is not waited for.
      if (!src.is_cuda()) {
        if (!out.bytes.empty()) std::memcpy(out.bytes.data(), src.data_ptr(), out.bytes.size());
        return out;
      }
      const uint64_t covered = waits_->Before();
      lane_->Download(out.bytes.data(), src.data_ptr(), out.bytes.size());
      if (!out.bytes.empty()) waits_->Waited(covered);
      return out;
    }
  }

  at::Tensor Dequantize(const Fp8Tensor& t, bool rowwise) const override {
    Use();
    const at::Tensor& codes = rowwise ? t.rowwise : t.columnwise;
    at::Tensor out = at::empty(codes.sizes(), Floats());
    gwc::Dequantize(codes.data_ptr<uint8_t>(), codes.numel(), t.format, ScaleInv(t),
                    out.data_ptr<float>(), kStream);
    return out;
  }

  LayerNormOut LayerNormForward(const at::Tensor& x, const LayerNormParams& ln) const override {
    Use();
    if (auto s = CheckInput("LayerNormForward", x, /*bf16_ok=*/true); !s.ok()) {
      throw std::logic_error(std::string(s.message()));
    }
    const int64_t m = x.size(0), k = x.size(1);
    LayerNormOut out{at::empty({m, k}, Floats()), at::empty({m}, Floats()),
                     at::empty({m}, Floats())};
    RunLayerNorm(x, ln, out.y.data_ptr<float>(), nullptr, out);
    return out;
  }
  at::Tensor LayerNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mu,
                               const at::Tensor& rstd, const LayerNormParams& ln,
                               at::Tensor& gamma_grad, at::Tensor& beta_grad) const override {
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
      gwc::LayerNormBackwardBf16(
          dy.data_ptr<float>(), static_cast<const uint16_t*>(x.data_ptr()), mu.data_ptr<float>(),
          rstd.data_ptr<float>(), ln.gamma.data_ptr<float>(), x.size(0), x.size(1),
          ln.zero_centered_gamma, dx.data_ptr<float>(), gamma_grad.data_ptr<float>(),
          beta_grad.data_ptr<float>(), kStream);
    } else {
      gwc::LayerNormBackward(dy.data_ptr<float>(), x.data_ptr<float>(), mu.data_ptr<float>(),
                             rstd.data_ptr<float>(), ln.gamma.data_ptr<float>(), x.size(0),
                             x.size(1), ln.zero_centered_gamma, dx.data_ptr<float>(),
                             gamma_grad.data_ptr<float>(), beta_grad.data_ptr<float>(), kStream);
    }
    return dx;
  }

  at::Tensor ActivationForward(kernels::Activation act, const at::Tensor& in,
                               int64_t width) const override {
    Use();
    at::Tensor out = at::empty({in.size(0), width}, Floats());
    gwc::ActivationForward(act, in.data_ptr<float>(), in.size(0), width, out.data_ptr<float>(),
                           nullptr, kStream);
    return out;
  }
  at::Tensor ActivationBackward(kernels::Activation act, const at::Tensor& dout,
                                const at::Tensor& in, int64_t width) const override {
    Use();
    at::Tensor din = at::empty_like(in);
    gwc::DActivationDbiasCast(act, dout.data_ptr<float>(), in.data_ptr<float>(), in.size(0), width,
                              din.data_ptr<float>(), nullptr, nullptr, kStream);
    return din;
  }

  at::Tensor Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias) const override {
    Use();
    at::Tensor y = at::empty({x.rows, w.rows}, Floats());
    Gemm(x.rowwise, x, w.rowwise, w, x.rows, w.rows, x.cols, y, false,
         gwc::GemmAccumulation::kFast);
    // The bias in fp32 after the GEMM, as the reference adds it: cuBLASLt's FP8 bias epilogue
    // takes only a bf16 bias (docs/cuda.md), which would round it.
    if (bias.defined()) y.add_(bias);
    return y;
  }
  at::Tensor Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) const override {
    Use();
    at::Tensor dx = at::empty({dy.rows, w.cols}, Floats());
    Gemm(dy.rowwise, dy, w.columnwise, w, dy.rows, w.cols, dy.cols, dx, false,
         gwc::GemmAccumulation::kSplit);
    return dx;
  }
  void Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc,
             bool accumulate) const override {
    Use();
    Gemm(dy.columnwise, dy, x.columnwise, x, dy.cols, x.cols, dy.rows, acc, accumulate,
         gwc::GemmAccumulation::kSplit);
  }
  void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) const override {
    Use();
    // A bf16 gradient is widened first (exact), so its sum is the fp32 path's, bit for bit.
    acc.add_((g.scalar_type() == at::kFloat ? g : g.to(at::kFloat)).sum(0));
  }
  // Through libtorch's reductions, which keep NaN; each reads its result back to the host (a
  // synchronisation): the GPU fast path moves these checks onto the device.
  float AbsMax(const at::Tensor& x) const override {
    Use();
    if (x.numel() == 0) return 0.0f;
    const uint64_t covered = waits_->Before();
    const float amax = x.abs().max().item<float>();  // waits for the reduction
    waits_->Waited(covered);
    return amax;
  }
  float AddAbsMax(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) const override {
    Use();
    at::add_out(out, a, b);
    return AbsMax(out);
  }
  // The reduction, then its copy into pinned memory, queued behind it as a cast's scalars are.
  CastScalars AbsMaxLater(const at::Tensor& x) const override {
    Use();
    if (x.numel() == 0) return CastScalars(1.0f, 1.0f, 0.0f);
    return ReadBackLater(x.abs().max().reshape({1}), [](const float* v) {
      return std::array<float, 3>{1.0f, 1.0f, v[0]};
    });
  }

  // The roll on the device (cuda::DelayedScalingRoll, one launch): this step's amaxes and which
  // roles step cross as one small copy from pinned memory, queued without a wait. Histories
  // longer than the kernel's limit roll through the host default (a copy out and back).
  void RollScaling(ScalingTensors& s, const std::vector<int64_t>& roles,
                   const std::vector<float>& amaxes, kernels::Fp8Format format,
                   const RecipeConfig& config) const override {
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

  void Synchronize() const override {
    Use();
    const uint64_t covered = waits_->Before();
    GRADWIRE_CUDA_CHECK(cudaStreamSynchronize(copy_stream_));
    GRADWIRE_CUDA_CHECK(cudaStreamSynchronize(kStream));
    waits_->Waited(covered);
  }
  int64_t HostWaits() const override { return waits_->waits(); }

 private:
  void Use() const { GRADWIRE_CUDA_CHECK(cudaSetDevice(device_)); }
  at::TensorOptions Floats() const {
    return at::TensorOptions().dtype(at::kFloat).device(device());
  }
  at::TensorOptions Bytes() const { return at::TensorOptions().dtype(at::kByte).device(device()); }

  // An F32, BF16 or F16 view on the device in its own dtype, [rows, cols], through the lane
  // (pinned slots when staging is on and the tensor is large enough, else one pageable copy, on
  // the copy stream). v's bytes are free when this returns, and every later launch on the compute
  // stream sees the tensor's bytes.
  at::Tensor Narrow(const wire::TensorView& v, int64_t rows, int64_t cols) const {
    const at::ScalarType type = v.dtype == wire::DType::kF32    ? at::kFloat
                                : v.dtype == wire::DType::kBF16 ? at::kBFloat16
                                                                : at::kHalf;
    at::Tensor dev = at::empty({rows, cols}, at::TensorOptions(type).device(device()));
    lane_->Upload(dev.data_ptr(), v.data, size_t(rows * cols * wire::ElementSize(v.dtype)));
    return dev;
  }
  // A contiguous host tensor's copy on this device, through the lane.
  at::Tensor Upload(const at::Tensor& host) const {
    const at::Tensor src = host.contiguous();
    at::Tensor dev = at::empty(src.sizes(), src.options().device(device()));
    lane_->Upload(dev.data_ptr(), src.data_ptr(), size_t(src.numel()) * src.element_size());
    return dev;
  }

  // The lane's operations: copies and events on the copy stream and the compute stream, and
  // landing blocks from libtorch's allocator (its reuse of them ordered on the compute stream),
  // held here until the lane gives them back.
  LaneOps LaneOpsOn() {
    LaneOps ops;
    const cudaStream_t copy = copy_stream_;
    CopyStream* events = copy_.get();
    ops.to_device = [copy](void* d, const void* h, size_t n) {
      GRADWIRE_CUDA_CHECK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, copy));
    };
    ops.to_host = [copy](void* h, const void* d, size_t n) {
      GRADWIRE_CUDA_CHECK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, copy));
      GRADWIRE_CUDA_CHECK(cudaStreamSynchronize(copy));  // the copy stream only
    };
    ops.device_copy = [](void* dst, const void* src, size_t n) {
      GRADWIRE_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, kStream));
    };
    ops.record_compute = [events](int e) {
      GRADWIRE_CUDA_CHECK(cudaEventRecord(events->event(e), kStream));
    };
    ops.record_copy = [events, copy](int e) {
      GRADWIRE_CUDA_CHECK(cudaEventRecord(events->event(e), copy));
    };
    ops.compute_waits = [events](int e) {
      GRADWIRE_CUDA_CHECK(cudaStreamWaitEvent(kStream, events->event(e), 0));
    };
    ops.copy_waits = [events, copy](int e) {
      GRADWIRE_CUDA_CHECK(cudaStreamWaitEvent(copy, events->event(e), 0));
    };
    ops.alloc = [this](size_t n) {
      at::Tensor block = at::empty({int64_t(n)}, Bytes());
      void* p = block.data_ptr();
      landings_[p] = std::move(block);
      return p;
    };
    ops.release = [this](void* p) { landings_.erase(p); };
    return ops;
  }

  // A contiguous 2-D float32 (or, with bf16_ok, bfloat16) tensor on this device, or why not.
  absl::Status CheckInput(const char* what, const at::Tensor& x, bool bf16_ok = false) const {
    const bool type_ok =
        x.scalar_type() == at::kFloat || (bf16_ok && x.scalar_type() == at::kBFloat16);
    if (x.dim() != 2 || !type_ok || !x.is_contiguous() || x.device() != device()) {
      return absl::InternalError(absl::StrCat("CudaBackend::", what, " expects a contiguous 2-D ",
                                              bf16_ok ? "float32 or bfloat16" : "float32",
                                              " tensor on ", device().str()));
    }
    return absl::OkStatus();
  }

  // A cast's outputs before its kernel runs: the codes `usage` asks for, and scale, scale_inv and
  // amax in 16-byte slots of one allocation (cuBLASLt reads scale_inv and needs it 16-byte
  // aligned; the allocator's blocks are). `o` points the kernel at them; under delayed scaling
  // the scale is already on its way to the device.
  struct PendingCast {
    Fp8Tensor out;
    at::Tensor scalars;
    gwc::Fp8Output o;
  };
  absl::StatusOr<PendingCast> BeginCast(const char* what, int64_t rows, int64_t cols,
                                        const QuantizerConfig& config, CastUsage usage) const {
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
      // A host value (a replay's, or a given one): pageable host to device, copied to staging
      // before the call returns, so `given` may go away (no synchronisation).
      const float given = config.scale_of.has_value() ? config.scale_of->scale() : config.scale;
      GRADWIRE_CUDA_CHECK(
          cudaMemcpyAsync(s, &given, sizeof(float), cudaMemcpyHostToDevice, kStream));
    }
    return c;
  }
  // After the kernel: scale_inv stays on the device for the GEMMs, and scale, scale_inv and amax
  // cross to pinned host memory behind the kernel, in stream order, without a wait (libtorch's
  // non-blocking copy, which keeps the pinned block from reuse until it has run). The host
  // reads them when first asked for (CastScalars), waiting then only if the copy is not known
  // to have run (StreamWaits).
  Fp8Tensor EndCast(PendingCast c) const {
    c.out.scalars = ReadBackLater(c.scalars, [](const float* v) {
      return std::array<float, 3>{v[0], v[4], v[8]};
    });
    c.out.scale_inv_device = c.scalars.narrow(0, 4, 1);
    return std::move(c.out);
  }

  // fp32 values on this device copied into pinned memory behind everything queued so far, and a
  // reader that waits for that copy (unless a wait since has covered it) and picks scale,
  // scale_inv and amax from them.
  CastScalars ReadBackLater(const at::Tensor& device_values,
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

  static const float* ScaleInv(const Fp8Tensor& t) {
    if (!t.scale_inv_device.defined()) {
      throw std::logic_error("CudaBackend: an FP8 tensor without its device scale_inv");
    }
    return t.scale_inv_device.data_ptr<float>();
  }

  // codes [r, c] padded with zero codes (+0 in both formats) to [rows, cols], or itself.
  at::Tensor Pad(const at::Tensor& codes, int64_t rows, int64_t cols) const {
    const int64_t r = codes.size(0), c = codes.size(1);
    if (r == rows && c == cols) return codes;
    at::Tensor out = at::zeros({rows, cols}, Bytes());
    GRADWIRE_CUDA_CHECK(cudaMemcpy2DAsync(out.data_ptr<uint8_t>(), size_t(cols),
                                          codes.data_ptr<uint8_t>(), size_t(c), size_t(c),
                                          size_t(r), cudaMemcpyDeviceToDevice, kStream));
    return out;
  }

  // d[m, n] (=|+=) scale_inv_a scale_inv_b a[m, k] . b[n, k]^T on cuBLASLt. FP8 tensor cores take
  // multiples of 16 in m, n and k: other shapes run zero-padded (zero codes add nothing) and the
  // [m, n] corner is copied out.
  void Gemm(const at::Tensor& a, const Fp8Tensor& as, const at::Tensor& b, const Fp8Tensor& bs,
            int64_t m, int64_t n, int64_t k, at::Tensor& d, bool accumulate,
            gwc::GemmAccumulation accumulation) const {
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
  void GemmBothE5m2(const at::Tensor& a, const Fp8Tensor& as, const at::Tensor& b,
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
  static void Copy2D(const at::Tensor& from, int64_t from_ld, at::Tensor& to, int64_t to_ld,
                     int64_t rows, int64_t cols) {
    GRADWIRE_CUDA_CHECK(cudaMemcpy2DAsync(
        to.data_ptr<float>(), size_t(to_ld) * 4, from.data_ptr<float>(), size_t(from_ld) * 4,
        size_t(cols) * 4, size_t(rows), cudaMemcpyDeviceToDevice, kStream));
  }

  int device_;
  std::string description_;
  std::unique_ptr<CopyStream> copy_ = std::make_unique<CopyStream>();
  const cudaStream_t copy_stream_;  // copy_'s stream, or the compute stream (see the constructor)
  std::unique_ptr<PinnedStaging> staging_;  // null: plain copies (CudaStaging() 0)
  // Landing blocks the lane holds (touched only under the lane's lock).
  mutable std::map<void*, at::Tensor> landings_;
  std::unique_ptr<CopyLane> lane_;
  // Shared with the readers of the casts' scalars, which may outlive the backend.
  std::shared_ptr<StreamWaits> waits_ = std::make_shared<StreamWaits>();
};

}  // namespace

bool CudaBackendBuilt() { return true; }

absl::StatusOr<BackendPtr> MakeCudaBackend(int device) {
  if (!at::hasCUDA()) {
    return absl::UnavailableError(
        "this build's libtorch has no CUDA support, so the CUDA backend cannot allocate device "
        "tensors (build against a libtorch with CUDA)");
  }
  std::string why;
  const int count = gwc::DeviceCount(&why);
  if (count == 0) return absl::UnavailableError(absl::StrCat("no usable CUDA device (", why, ")"));
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " does not exist; this machine has ", count));
  }
  GRADWIRE_CUDA_CHECK(cudaSetDevice(device));
  const int64_t staging = CudaStaging();
  const char* copy_stream = std::getenv("GRADWIRE_CUDA_COPY_STREAM");
  const bool own_copy_stream = copy_stream == nullptr || (std::string(copy_stream) != "0" &&
                                                          std::string(copy_stream) != "off");
  try {
    return BackendPtr(std::make_shared<CudaBackend>(device, gwc::DeviceDescription(device), staging,
                                                    own_copy_stream));
  } catch (const std::exception& e) {  // the copy stream, its events or the pinned slots
    return absl::ResourceExhaustedError(absl::StrCat(
        "the CUDA backend could not set up its copy stream and events",
        staging > 0
            ? absl::StrCat(" or pinned staging of 2 x ", staging >> 20, " MiB (--cuda-staging-mib)")
            : std::string(),
        ": ", e.what()));
  }
}

}  // namespace gradwire::core
