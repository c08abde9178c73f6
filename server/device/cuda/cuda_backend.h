// The CUDA backend's class (server/device/cuda): the modules' computations on one GPU through
// kernels/cuda and cuBLASLt. Its work is in two files: the wire crossings, copy lane and staging,
// stream waits and set-up in crossing.cc; the casts, LayerNorm, activations, GEMMs, reductions and
// scaling rolls in compute.cc. Nothing outside server/device/cuda includes this header: the rest of
// the server reaches the backend through MakeCudaBackend (backend.h).
//
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
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/kernels/cuda/cast.h"
#include "gradwire/kernels/cuda/gemm_lt.h"
#include "server/device/backend.h"
#include "server/device/copy_lane.h"

namespace gradwire::device::cuda_backend {

namespace gwc = kernels::cuda;

inline constexpr cudaStream_t kStream = nullptr;  // the legacy default stream (see above)
// The longest amax history cuda::DelayedScalingRoll takes (it stages a row in shared memory).
inline constexpr int64_t kMaxDeviceHistory = 8192;

inline int64_t Up16(int64_t v) { return (v + 15) / 16 * 16; }

class CopyStream;
class PinnedStaging;

// The host's reads of values queued to cross back behind the kernels (the casts' scalars): how
// many copies have been queued, and up to which one they are known to have run. A read waits for
// the stream only when its copy is not known done, and that one wait then covers every copy
// queued before it: the first read after a forward's kernels waits once, the others not at all.
class StreamWaits {
 public:
  // Call after queuing a copy: its mark.
  uint64_t Queued() { return queued_.fetch_add(1) + 1; }
  void WaitFor(uint64_t mark, int device);
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
  CudaBackend(int device, std::string description, int64_t staging_chunk, bool own_copy_stream);
  ~CudaBackend() override;

  const char* name() const override { return "cuda"; }
  at::Device device() const override { return at::Device(at::kCUDA, at::DeviceIndex(device_)); }
  std::string Describe() const override { return description_ + ", CUDA FP8 backend (cuBLASLt)"; }

  at::Tensor ToDevice(const at::Tensor& t) const override;
  at::Tensor ToHost(const at::Tensor& t) const override;

  absl::StatusOr<Fp8Tensor> Cast(const at::Tensor& x, const QuantizerConfig& config,
                                 CastUsage usage) const override;

  // Its own kernels for the fused forms, FromWireBf16, AbsMaxLater and RollScaling; the defaults
  // for Widen, NarrowBf16, PrepareWeight, FpropBf16 and the grouped GEMMs.
  bool Supports(Op op) const override;

  // The fused forms: the LayerNorm / activation / d-activation kernels write the FP8 cast of
  // their result in the same pass (under current scaling, a first pass finds the amax), and the
  // fp32 result only when asked. Each kernel computes its values with the same code whether or not
  // it casts, so the fused form equals the composed one bit for bit (the parity harness's rows).
  absl::StatusOr<Fp8Tensor> LayerNormCast(const at::Tensor& x, const LayerNormParams& ln,
                                          const QuantizerConfig& config, CastUsage usage,
                                          bool keep_y, LayerNormOut* ln_out) const override;
  // LayerNorm's kernels on a float32 or (read as it is, widened in the kernel) bfloat16 x.
  void RunLayerNorm(const at::Tensor& x, const LayerNormParams& ln, float* y,
                    const gwc::Fp8Output* o, LayerNormOut& out) const;
  absl::StatusOr<Fp8Tensor> ActivationCast(kernels::Activation act, const at::Tensor& in,
                                           int64_t width, const QuantizerConfig& config,
                                           CastUsage usage, at::Tensor* y) const override;
  absl::StatusOr<Fp8Tensor> DActivationCast(kernels::Activation act, const at::Tensor& dout,
                                            const at::Tensor& in, int64_t width,
                                            const QuantizerConfig& config, CastUsage usage,
                                            at::Tensor* din) const override;

  Fp8Tensor FromCodes(const uint8_t* host_codes, int64_t rows, int64_t cols,
                      kernels::Fp8Format format, float scale_inv, CastUsage usage) const override;

  // A wire tensor crosses to the GPU in its own dtype: FP8 as codes (FromCodes, then decoded on
  // the device), bf16/f16 as 2-byte values widened there by libtorch (exact), f32 as it is.
  at::Tensor FromWire(const wire::TensorView& v, int64_t rows, int64_t cols, Fp8Tensor* codes,
                      CastUsage usage) const override;
  // Kept in bf16 on the device: the casts read it as it is (CastTransposeBf16).
  at::Tensor FromWireBf16(const wire::TensorView& v, int64_t rows, int64_t cols) const override;

  wire::EncodedTensor ToWire(const at::Tensor& x, wire::DType dtype,
                             std::vector<int64_t> shape) const override;

  at::Tensor Dequantize(const Fp8Tensor& t, bool rowwise) const override;

  LayerNormOut LayerNormForward(const at::Tensor& x, const LayerNormParams& ln) const override;
  at::Tensor LayerNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mu,
                               const at::Tensor& rstd, const LayerNormParams& ln,
                               at::Tensor& gamma_grad, at::Tensor& beta_grad) const override;

  at::Tensor ActivationForward(kernels::Activation act, const at::Tensor& in,
                               int64_t width) const override;
  at::Tensor ActivationBackward(kernels::Activation act, const at::Tensor& dout,
                                const at::Tensor& in, int64_t width) const override;

  at::Tensor Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias) const override;
  at::Tensor Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) const override;
  void Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc,
             bool accumulate) const override;
  void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) const override;
  // Through libtorch's reductions, which keep NaN; each reads its result back to the host (a
  // synchronisation): the GPU fast path moves these checks onto the device.
  float AbsMax(const at::Tensor& x) const override;
  float AddAbsMax(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) const override;
  // The reduction, then its copy into pinned memory, queued behind it as a cast's scalars are.
  CastScalars AbsMaxLater(const at::Tensor& x) const override;

  // The roll on the device (cuda::DelayedScalingRoll, one launch): this step's amaxes and which
  // roles step cross as one small copy from pinned memory, queued without a wait. Histories
  // longer than the kernel's limit roll through the host default (a copy out and back).
  void RollScaling(ScalingTensors& s, const std::vector<int64_t>& roles,
                   const std::vector<float>& amaxes, kernels::Fp8Format format,
                   const RecipeConfig& config) const override;

  void Synchronize() const override;
  int64_t HostWaits() const override { return waits_->waits(); }

 private:
  void Use() const;  // makes this backend's device current
  at::TensorOptions Floats() const {
    return at::TensorOptions().dtype(at::kFloat).device(device());
  }
  at::TensorOptions Bytes() const { return at::TensorOptions().dtype(at::kByte).device(device()); }

  // An F32, BF16 or F16 view on the device in its own dtype, [rows, cols], through the lane
  // (pinned slots when staging is on and the tensor is large enough, else one pageable copy, on
  // the copy stream). v's bytes are free when this returns, and every later launch on the compute
  // stream sees the tensor's bytes.
  at::Tensor Narrow(const wire::TensorView& v, int64_t rows, int64_t cols) const;
  // A contiguous host tensor's copy on this device, through the lane.
  at::Tensor Upload(const at::Tensor& host) const;

  // The lane's operations: copies and events on the copy stream and the compute stream, and
  // landing blocks from libtorch's allocator (its reuse of them ordered on the compute stream),
  // held here until the lane gives them back.
  LaneOps LaneOpsOn();

  // A contiguous 2-D float32 (or, with bf16_ok, bfloat16) tensor on this device, or why not.
  absl::Status CheckInput(const char* what, const at::Tensor& x, bool bf16_ok = false) const;

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
                                        const QuantizerConfig& config, CastUsage usage) const;
  // After the kernel: scale_inv stays on the device for the GEMMs, and scale, scale_inv and amax
  // cross to pinned host memory behind the kernel, in stream order, without a wait (libtorch's
  // non-blocking copy, which keeps the pinned block from reuse until it has run). The host
  // reads them when first asked for (CastScalars), waiting then only if the copy is not known
  // to have run (StreamWaits).
  Fp8Tensor EndCast(PendingCast c) const;

  // fp32 values on this device copied into pinned memory behind everything queued so far, and a
  // reader that waits for that copy (unless a wait since has covered it) and picks scale,
  // scale_inv and amax from them.
  CastScalars ReadBackLater(const at::Tensor& device_values,
                            std::array<float, 3> (*pick)(const float*)) const;

  static const float* ScaleInv(const Fp8Tensor& t);

  // codes [r, c] padded with zero codes (+0 in both formats) to [rows, cols], or itself.
  at::Tensor Pad(const at::Tensor& codes, int64_t rows, int64_t cols) const;

  // d[m, n] (=|+=) scale_inv_a scale_inv_b a[m, k] . b[n, k]^T on cuBLASLt. FP8 tensor cores take
  // multiples of 16 in m, n and k: other shapes run zero-padded (zero codes add nothing) and the
  // [m, n] corner is copied out.
  void Gemm(const at::Tensor& a, const Fp8Tensor& as, const at::Tensor& b, const Fp8Tensor& bs,
            int64_t m, int64_t n, int64_t k, at::Tensor& d, bool accumulate,
            gwc::GemmAccumulation accumulation) const;

  // E5M2 x E5M2 (a wgrad of E5M2 gradient codes and an input that came as E5M2 codes): the FP8
  // tensor cores need one E4M3 operand, and E5M2 does not fit E4M3 exactly. Both operands are
  // decoded without their scales (exact in fp32), multiplied in float64 and scaled once: a rare
  // path, slower but more exact than the FP8 GEMM it stands in for.
  void GemmBothE5m2(const at::Tensor& a, const Fp8Tensor& as, const at::Tensor& b,
                    const Fp8Tensor& bs, at::Tensor& d, bool accumulate) const;

  // The [rows, cols] corner of fp32 `from` (row pitch from_ld elements) into `to` (pitch to_ld).
  static void Copy2D(const at::Tensor& from, int64_t from_ld, at::Tensor& to, int64_t to_ld,
                     int64_t rows, int64_t cols);

  int device_;
  std::string description_;
  std::unique_ptr<CopyStream> copy_;  // made first: the staging and the lane queue work on it
  const cudaStream_t copy_stream_;    // copy_'s stream, or the compute stream (see the constructor)
  std::unique_ptr<PinnedStaging> staging_;  // null: plain copies (CudaStaging() 0)
  // Landing blocks the lane holds (touched only under the lane's lock).
  mutable std::map<void*, at::Tensor> landings_;
  std::unique_ptr<CopyLane> lane_;
  // Shared with the readers of the casts' scalars, which may outlive the backend.
  std::shared_ptr<StreamWaits> waits_ = std::make_shared<StreamWaits>();
};

}  // namespace gradwire::device::cuda_backend
