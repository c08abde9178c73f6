// Reused host buffers for the CPU backend's temporaries (decoded GEMM operands, partial sums), so
// a forward or backward allocates no fresh memory for them: a buffer of the size a call needs is
// taken from a process-wide free list and given back when the lease ends. Fresh memory costs a
// page fault per 4 KiB on first touch, which on a virtual machine can cost more than the work
// done in it (docs/performance.md); large buffers are also backed by transparent huge pages where
// the kernel allows it (MADV_HUGEPAGE), so the first touch faults once per 2 MiB.
//
// Bounded: the free list keeps at most kScratchKeepBytes; ReleaseScratch() empties it (the server
// calls it from its housekeeping when idle, so idle memory goes back to the system).
#pragma once

#include <cstddef>
#include <cstdint>

namespace gradwire::kernels::cpu {

inline constexpr size_t kScratchKeepBytes = size_t(512) << 20;

// A leased buffer; movable, returned to the free list when destroyed. Its contents are whatever
// the previous lease left (uninitialised on first use).
class Scratch {
 public:
  Scratch() = default;
  ~Scratch();
  Scratch(Scratch&& other) noexcept;
  Scratch& operator=(Scratch&& other) noexcept;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  void* data() const { return data_; }
  float* floats() const { return static_cast<float*>(data_); }
  size_t bytes() const { return bytes_; }

 private:
  friend Scratch TakeScratch(size_t bytes);
  void* data_ = nullptr;
  size_t bytes_ = 0;     // what the caller asked for
  size_t capacity_ = 0;  // what the buffer holds
};

// A buffer of at least `bytes` bytes (64-byte aligned): a free one when one fits without wasting
// more than it holds, else a new one. Thread-safe.
Scratch TakeScratch(size_t bytes);

// Frees every buffer on the free list (leased ones are freed when their lease ends).
void ReleaseScratch();

struct ScratchStats {
  int64_t free_bytes = 0;    // on the free list
  int64_t leased_bytes = 0;  // in use
  int64_t allocations = 0;   // buffers ever allocated (a steady state stops counting up)
};
ScratchStats GetScratchStats();

// Host memory for a large, long-lived buffer: 2 MiB aligned and advised as huge pages when at
// least 4 MiB, else 64-byte aligned. Free with FreeHostBuffer. Null on failure.
void* AllocateHostBuffer(size_t bytes);
void FreeHostBuffer(void* p);

}  // namespace gradwire::kernels::cpu
