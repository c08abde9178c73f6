#include "server/device/copy_lane.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace gradwire::device {

CopyLane::CopyLane(LaneOps ops, StagedCopier* staged, size_t staged_min_bytes,
                   size_t landing_max_bytes, size_t landing_grain)
    : ops_(std::move(ops)),
      staged_(staged),
      staged_min_(staged_min_bytes),
      landing_max_(landing_max_bytes),
      landing_grain_(std::max<size_t>(1, landing_grain)) {
  if (!ops_.to_device || !ops_.to_host || !ops_.device_copy || !ops_.record_compute ||
      !ops_.record_copy || !ops_.compute_waits || !ops_.copy_waits || !ops_.alloc ||
      !ops_.release) {
    throw std::invalid_argument("CopyLane: every operation is needed");
  }
}

CopyLane::~CopyLane() {
  for (Landing& l : landings_) {
    if (l.p != nullptr) ops_.release(l.p);
  }
}

size_t CopyLane::landing_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t most = 0;
  for (const Landing& l : landings_) most = std::max(most, l.bytes);
  return most;
}

void CopyLane::Cross(void* device, const void* host, size_t n) {
  if (staged_ != nullptr && n >= staged_min_) {
    staged_->ToDevice(device, host, n);
  } else {
    ops_.to_device(device, host, n);
  }
}

void CopyLane::Straight(void* dst, const void* host, size_t n) {
  // dst is a block of the compute queue's: it may still be read by compute work queued before it
  // was freed, so the copy waits for everything queued there so far.
  ops_.record_compute(kComputed);
  ops_.copy_waits(kComputed);
  try {
    Cross(dst, host, n);
  } catch (...) {
    // Part of the crossing may be queued: whoever reuses dst next on the compute queue comes
    // after it.
    ops_.record_copy(kCopied);
    ops_.compute_waits(kCopied);
    throw;
  }
  ops_.record_copy(kCopied);
  ops_.compute_waits(kCopied);
}

void CopyLane::Upload(void* dst, const void* host, size_t n) {
  if (n == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (n > landing_max_) return Straight(dst, host, n);
  const int i = next_;
  next_ = (next_ + 1) % kLandings;
  Landing& l = landings_[size_t(i)];
  // What this landing held last has been copied out by the compute queue.
  ops_.copy_waits(kFreed + i);
  if (l.bytes < n) {
    // A bigger landing, of n rounded up to the grain. The old one's last use (its crossing,
    // then compute's copy out of it) is ordered before the compute queue's present point, where
    // the allocator reuses it. The new block may be one that compute work queued earlier still
    // reads: the copy waits for that once, here, and never again for this landing. Without the
    // memory for it, this upload crosses straight.
    const size_t bytes =
        std::min(landing_max_, (n + landing_grain_ - 1) / landing_grain_ * landing_grain_);
    if (l.p != nullptr) ops_.release(l.p);
    l.p = nullptr;
    l.bytes = 0;
    try {
      l.p = ops_.alloc(bytes);
    } catch (const std::exception&) {
      return Straight(dst, host, n);
    }
    l.bytes = bytes;
    ops_.record_compute(kComputed);
    ops_.copy_waits(kComputed);
  }
  try {
    Cross(l.p, host, n);
  } catch (...) {
    // dst is untouched (compute copies the landing out only after a crossing). Part of this one
    // may be queued: the compute queue, where the landing's block is reused once it is released,
    // comes after it.
    ops_.record_copy(kLanded + i);
    ops_.compute_waits(kLanded + i);
    ops_.record_compute(kFreed + i);
    throw;
  }
  ops_.record_copy(kLanded + i);
  ops_.compute_waits(kLanded + i);
  ops_.device_copy(dst, l.p, n);
  ops_.record_compute(kFreed + i);
}

void CopyLane::Download(void* host, const void* src, size_t n) {
  if (n == 0) return;
  {
    // Only the ordering under the lock: the copy queue has its wait for compute before this
    // download's copies, whatever another thread queues in between. The host's wait for the copy
    // then holds nobody else up.
    std::lock_guard<std::mutex> lock(mu_);
    ops_.record_compute(kComputed);
    ops_.copy_waits(kComputed);
  }
  if (staged_ != nullptr && n >= staged_min_) {
    staged_->ToHost(host, src, n);
  } else {
    ops_.to_host(host, src, n);
  }
}

}  // namespace gradwire::device
