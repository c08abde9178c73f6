// Wire tensors crossing to and from a device on a copy queue of their own, so that a request's
// input can cross while the compute queue still runs earlier calls' work (a backward's deferred
// weight-gradient GEMMs, a delayed-scaling roll), and an output's copy back waits for the compute
// that wrote it and nothing queued after.
//
// Two queues run asynchronously to the host and to each other: compute (where the kernels and
// the compute allocator's reuse of freed blocks are ordered) and copy. Events order them:
//
//   Upload     the bytes cross on the copy queue into a landing zone the lane owns, then the
//              compute queue, waiting for that crossing, copies them into the caller's tensor
//              and marks the landing free again. The copy queue writes a landing only after the
//              compute queue has marked it free, so a crossing never waits for compute work
//              queued since. Blocks the compute allocator hands out may still be read by compute
//              work queued before they were freed; the copy queue never writes one of those
//              before the compute queue has passed that work (a new landing waits for it once,
//              and the caller's tensor is written by the compute queue itself).
//   Download   the copy queue waits for the compute queue's work so far, then copies; the host
//              waits for the copy queue only.
//
// Torch-free and CUDA-free, like StagedCopier (which the lane may use for the pinned crossings,
// its operations then on the copy queue): the CUDA backend fills `LaneOps` with streams, events
// and its allocator, and tests/core/copy_lane_test.cc with a model of two lazy queues on which a
// missing wait shows as wrong bytes and a needless one as compute work run too early.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "server/device/staged_copy.h"

namespace gradwire::device {

struct LaneOps {
  // On the copy queue, in order: host (pageable) to device, device to host (pageable). to_host
  // returns when the host holds the bytes; to_device when the host's bytes may be reused.
  std::function<void(void* device, const void* host, size_t n)> to_device;
  std::function<void(void* host, const void* device, size_t n)> to_host;
  // On the compute queue: a device-to-device copy.
  std::function<void(void* dst, const void* src, size_t n)> device_copy;
  // Events, named by small integers (see CopyLane's kEvents): record the point a queue has reached
  // so far; make the other queue wait for a recorded point. Waiting for an event never recorded
  // returns at once (as cudaStreamWaitEvent does).
  std::function<void(int event)> record_compute, record_copy;
  std::function<void(int event)> compute_waits, copy_waits;
  // Device memory for a landing zone, from the compute queue's allocator (its reuse ordered on the
  // compute queue): allocate, and give back once nothing queued on either queue still uses it.
  std::function<void*(size_t n)> alloc;
  std::function<void(void* p)> release;
};

class CopyLane {
 public:
  // Event names: kEvents of them, 0 .. kEvents - 1.
  static constexpr int kLandings = 2;
  static constexpr int kLanded = 0;                     // + landing: its crossing is done
  static constexpr int kFreed = kLanded + kLandings;    // + landing: compute copied it out
  static constexpr int kComputed = kFreed + kLandings;  // compute's point, for the copy to wait on
  static constexpr int kCopied = kComputed + 1;         // a crossing without a landing
  static constexpr int kEvents = kCopied + 1;

  // `staged` (may be null): the pinned pipeline for crossings of at least `staged_min_bytes`, its
  // ops on the copy queue. An upload larger than `landing_max_bytes` crosses straight into the
  // caller's tensor, after the compute queue's work so far (no overlap, and no landing that big),
  // and so does one whose landing cannot be allocated (`alloc` throws). A landing grows to the
  // upload it must hold, rounded up to `landing_grain` bytes (at most landing_max_bytes).
  CopyLane(LaneOps ops, StagedCopier* staged, size_t staged_min_bytes, size_t landing_max_bytes,
           size_t landing_grain = size_t(1) << 20);
  // Gives the landings back (the caller has waited for both queues first).
  ~CopyLane();
  CopyLane(const CopyLane&) = delete;
  CopyLane& operator=(const CopyLane&) = delete;

  // host -> device: `dst` (n bytes, from the compute queue's allocator) holds the bytes for every
  // compute work queued after this returns; the host's bytes may be reused then.
  void Upload(void* dst, const void* host, size_t n);
  // device -> host: `src` as the compute queue's work queued so far leaves it. Returns when `host`
  // holds the bytes. The lane's lock is held only while the ordering is queued, not while the
  // host waits.
  void Download(void* host, const void* src, size_t n);

  // The largest landing so far (bytes; tests).
  size_t landing_bytes() const;

 private:
  // Host to device on the copy queue (pinned pipeline or plain copy).
  void Cross(void* device, const void* host, size_t n);
  // An upload without a landing: after the compute queue's work so far, into dst.
  void Straight(void* dst, const void* host, size_t n);

  LaneOps ops_;
  StagedCopier* staged_;
  const size_t staged_min_, landing_max_, landing_grain_;
  mutable std::mutex mu_;
  struct Landing {
    void* p = nullptr;
    size_t bytes = 0;
  };
  std::vector<Landing> landings_ = std::vector<Landing>(kLandings);
  int next_ = 0;  // the landing the next upload uses
};

}  // namespace gradwire::device
