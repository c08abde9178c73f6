// Copies between pageable host memory and a device through a ring of pinned staging buffers, the
// way a GPU backend moves wire tensors: a pageable copy runs at a fraction of a pinned one (on the
// H100 machine 7.7 against 51 GiB/s host to device, docs/cuda.md), so each chunk is first copied
// on the host into a pinned slot (on the CPU backend's thread pool), then crosses asynchronously,
// while the host fills the next slot. Device → host runs the same pipeline the other way.
//
// Torch-free and CUDA-free: the device side is a set of operations (`StagingOps`) that the CUDA
// backend fills with cudaMemcpyAsync and events on its stream, and a test fills with a simulated
// asynchronous queue that copies only when waited on, so an ordering mistake shows as wrong bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace gradwire::device {

struct StagingOps {
  // Enqueue (asynchronously, in order) a copy of n bytes from a pinned slot to device memory, and
  // from device memory into a pinned slot.
  std::function<void(void* device, const void* pinned, size_t n)> to_device;
  std::function<void(void* pinned, const void* device, size_t n)> to_host;
  // Mark the point in the queue after the copies enqueued so far as slot `slot`'s; wait on the
  // host until the queue has passed slot `slot`'s last mark (no mark yet: return at once).
  std::function<void(int slot)> record;
  std::function<void(int slot)> wait;
};

class StagedCopier {
 public:
  // `slots` pinned buffers of `chunk_bytes` each, owned by the caller and alive while this is.
  // host_copy: the host-side copy into and out of a slot (default: memcpy split over the CPU
  // thread pool).
  StagedCopier(std::vector<void*> slots, size_t chunk_bytes, StagingOps ops,
               std::function<void(void*, const void*, size_t)> host_copy = {});

  // host → device. Returns once every byte of `host` has been copied into a slot: the caller may
  // free `host` then; the last crossings may still be in the queue, ordered before whatever the
  // caller enqueues next on the same stream.
  void ToDevice(void* device, const void* host, size_t bytes);
  // device → host. Returns when `host` holds the bytes. Waits for everything queued before it.
  void ToHost(void* host, const void* device, size_t bytes);

  size_t chunk_bytes() const { return chunk_; }
  int slots() const { return int(slots_.size()); }

 private:
  std::vector<void*> slots_;
  size_t chunk_;
  StagingOps ops_;
  std::function<void(void*, const void*, size_t)> host_copy_;
  std::mutex mu_;  // one pipeline at a time: the slots are shared
};

// memcpy of n bytes split over the CPU backend's thread pool (one piece when n is small).
void ParallelMemcpy(void* dst, const void* src, size_t n);

}  // namespace gradwire::device
