// The CUDA backend's crossings (cuda_backend.h): set-up, the wire tensors in and out through the
// copy lane and pinned staging on the copy stream, and the host's waits for the streams.
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
#include "device_query.h"
#include "server/device/cuda/cuda_backend.h"
#include "server/device/staged_copy.h"

namespace gradwire::device {
namespace cuda_backend {

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

void StreamWaits::WaitFor(uint64_t mark, int device) {
  if (done_.load() >= mark) return;
  const uint64_t covered = Before();
  GRADWIRE_CUDA_CHECK(cudaSetDevice(device));
  GRADWIRE_CUDA_CHECK(cudaStreamSynchronize(kStream));
  Waited(covered);
}

void CudaBackend::Use() const { GRADWIRE_CUDA_CHECK(cudaSetDevice(device_)); }

// own_copy_stream false: the wire copies go on the compute stream, straight into their tensors
// (no landing): GRADWIRE_CUDA_COPY_STREAM=0, a one-stream baseline for measuring what the copy
// stream changes. (Not quite the code before the lane: an upload there ended with a wait for
// the stream; here it is queued, ordered by the stream alone.)
CudaBackend::CudaBackend(int device, std::string description, int64_t staging_chunk,
                         bool own_copy_stream)
    : device_(device),
      description_(std::move(description)),
      copy_(std::make_unique<CopyStream>()),
      copy_stream_(own_copy_stream ? copy_->stream() : kStream) {
  if (staging_chunk > 0) {
    staging_ = std::make_unique<PinnedStaging>(size_t(staging_chunk), copy_stream_);
    description_ += absl::StrCat(", pinned staging ", staging_chunk >> 20, " MiB x 2");
  }
  description_ +=
      own_copy_stream ? ", wire copies on their own stream" : ", wire copies on the compute stream";
  lane_ = std::make_unique<CopyLane>(LaneOpsOn(), staging_ ? &staging_->copier() : nullptr,
                                     kStagedMinBytes, own_copy_stream ? kLandingMaxBytes : 0);
}

CudaBackend::~CudaBackend() {
  // Both streams finish before the lane gives its landings back and the staging frees its slots.
  (void)cudaSetDevice(device_);
  (void)cudaStreamSynchronize(copy_stream_);
  (void)cudaStreamSynchronize(kStream);
  lane_.reset();
  staging_.reset();
}

at::Tensor CudaBackend::ToDevice(const at::Tensor& t) const {
  Use();
  return t.device() == device() ? t.contiguous() : t.to(device()).contiguous();
}

at::Tensor CudaBackend::ToHost(const at::Tensor& t) const {
  return t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
}

Fp8Tensor CudaBackend::FromCodes(const uint8_t* host_codes, int64_t rows, int64_t cols,
                                 kernels::Fp8Format format, float scale_inv,
                                 CastUsage usage) const {
  Use();
  // The host reference makes the transpose and the amax; the codes then move as they are.
  Fp8Tensor out = device::FromCodes(host_codes, rows, cols, format, scale_inv, usage);
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
at::Tensor CudaBackend::FromWire(const wire::TensorView& v, int64_t rows, int64_t cols,
                                 Fp8Tensor* codes, CastUsage usage) const {
  Use();
  if (v.blocks.present()) {
    // Decoded on the host (the CUDA backend has no block-scaled recipe, so no kind asks for
    // these codes); the values cross as fp32.
    if (codes != nullptr) {
      throw std::logic_error("CudaBackend: block-scaled input codes asked for (no such recipe)");
    }
    return ToDevice(HostFromBlockScaledWire(v, rows, cols, nullptr, usage));
  }
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
at::Tensor CudaBackend::FromWireBf16(const wire::TensorView& v, int64_t rows, int64_t cols) const {
  Use();
  if (v.dtype != wire::DType::kBF16 || rows * cols != v.numel()) {
    throw std::logic_error("FromWireBf16: not a bf16 view of rows x cols");
  }
  return Narrow(v, rows, cols);
}

wire::EncodedTensor CudaBackend::ToWire(const at::Tensor& x, wire::DType dtype,
                                        std::vector<int64_t> shape) const {
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

void CudaBackend::Synchronize() const {
  Use();
  const uint64_t covered = waits_->Before();
  GRADWIRE_CUDA_CHECK(cudaStreamSynchronize(copy_stream_));
  GRADWIRE_CUDA_CHECK(cudaStreamSynchronize(kStream));
  waits_->Waited(covered);
}

// An F32, BF16 or F16 view on the device in its own dtype, [rows, cols], through the lane
// (pinned slots when staging is on and the tensor is large enough, else one pageable copy, on
// the copy stream). v's bytes are free when this returns, and every later launch on the compute
// stream sees the tensor's bytes.
at::Tensor CudaBackend::Narrow(const wire::TensorView& v, int64_t rows, int64_t cols) const {
  const at::ScalarType type = v.dtype == wire::DType::kF32    ? at::kFloat
                              : v.dtype == wire::DType::kBF16 ? at::kBFloat16
                                                              : at::kHalf;
  at::Tensor dev = at::empty({rows, cols}, at::TensorOptions(type).device(device()));
  lane_->Upload(dev.data_ptr(), v.data, size_t(rows * cols * wire::ElementSize(v.dtype)));
  return dev;
}

// A contiguous host tensor's copy on this device, through the lane.
at::Tensor CudaBackend::Upload(const at::Tensor& host) const {
  const at::Tensor src = host.contiguous();
  at::Tensor dev = at::empty(src.sizes(), src.options().device(device()));
  lane_->Upload(dev.data_ptr(), src.data_ptr(), size_t(src.numel()) * src.element_size());
  return dev;
}

// The lane's operations: copies and events on the copy stream and the compute stream, and
// landing blocks from libtorch's allocator (its reuse of them ordered on the compute stream),
// held here until the lane gives them back.
LaneOps CudaBackend::LaneOpsOn() {
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

}  // namespace cuda_backend

bool CudaBackendBuilt() { return true; }

absl::StatusOr<BackendPtr> MakeCudaBackend(int device) {
  if (!at::hasCUDA()) {
    return absl::UnavailableError(
        "this build's libtorch has no CUDA support, so the CUDA backend cannot allocate device "
        "tensors (build against a libtorch with CUDA)");
  }
  std::string why;
  const int count = kernels::cuda::DeviceCount(&why);
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
    return BackendPtr(std::make_shared<cuda_backend::CudaBackend>(
        device, kernels::cuda::DeviceDescription(device), staging, own_copy_stream));
  } catch (const std::exception& e) {  // the copy stream, its events or the pinned slots
    return absl::ResourceExhaustedError(absl::StrCat(
        "the CUDA backend could not set up its copy stream and events",
        staging > 0
            ? absl::StrCat(" or pinned staging of 2 x ", staging >> 20, " MiB (--cuda-staging-mib)")
            : std::string(),
        ": ", e.what()));
  }
}

}  // namespace gradwire::device
