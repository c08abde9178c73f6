#include "server/core/copy_lane.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace gradwire::core {

CopyLane::CopyLane(LaneOps ops, StagedCopier* staged, size_t staged_min_bytes,
                   size_t landing_max_bytes)
    : ops_(std::move(ops)),
      staged_(staged),
      staged_min_(staged_min_bytes),
      landing_max_(landing_max_bytes) {
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

void CopyLane::Upload(void* dst, const void* host, size_t n) {
  if (n == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (n > landing_max_) {
    // Straight into dst, a block of the compute queue's: it may still be read by compute work
    // queued before it was freed, so the copy waits for everything queued there so far.
    ops_.record_compute(kComputed);
    ops_.copy_waits(kComputed);
    Cross(dst, host, n);
    ops_.record_copy(kCopied);
    ops_.compute_waits(kCopied);
    return;
  }
  const int i = next_;
  next_ = (next_ + 1) % kLandings;
  Landing& l = landings_[size_t(i)];
  // What this landing held last has been copied out by the compute queue.
  ops_.copy_waits(kFreed + i);
  if (l.bytes < n) {
    // A bigger landing. The old one's last use (its crossing, then compute's copy out of it) is
    // ordered before the compute queue's present point, where the allocator reuses it. The new
    // block may be one that compute work queued earlier still reads: the copy waits for that
    // once, here, and never again for this landing.
    const size_t bytes = std::max(n, std::min(landing_max_, l.bytes * 2));
    if (l.p != nullptr) ops_.release(l.p);
    l.p = nullptr;
    l.bytes = 0;
    l.p = ops_.alloc(bytes);
    l.bytes = bytes;
    ops_.record_compute(kComputed);
    ops_.copy_waits(kComputed);
  }
  Cross(l.p, host, n);
  ops_.record_copy(kLanded + i);
  ops_.compute_waits(kLanded + i);
  ops_.device_copy(dst, l.p, n);
  ops_.record_compute(kFreed + i);
}

void CopyLane::Download(void* host, const void* src, size_t n) {
  if (n == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  ops_.record_compute(kComputed);
  ops_.copy_waits(kComputed);
  if (staged_ != nullptr && n >= staged_min_) {
    staged_->ToHost(host, src, n);
  } else {
    ops_.to_host(host, src, n);
  }
}

}  // namespace gradwire::core
