// Giving freed heap memory back to the operating system.
//
// glibc's malloc keeps freed memory in its arenas for reuse and returns it only from the top of a
// heap. Under training load the server allocates weight workspaces (FP8 weights and their decoded
// floats, hundreds of KiB each, one per weight version) that live as long as the contexts made
// under that version, interleaved with small long-lived allocations. The freed workspaces leave
// holes below live chunks that free() never returns, so RSS creeps up while the memory in use
// stays flat (docs/reliability.md, soak). malloc_trim walks every arena and releases the whole
// free pages inside those holes; the server calls TrimHeap periodically from its housekeeping
// thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gradwire::core {

struct HeapTrimResult {
  bool supported = false;  // false without glibc's malloc_trim (then nothing was done)
  int64_t rss_before_bytes = -1;
  int64_t rss_after_bytes = -1;
  double seconds = 0;  // time spent in malloc_trim
};

// Large blocks from the heap instead of a fresh mapping each. glibc serves every block above its
// mmap threshold (128 KiB, rising to at most 32 MiB) with a new mmap and unmaps it on free, so each
// large request buffer, decoded tensor or response pays a page fault per 4 KiB on first touch: on
// a virtual machine that costs more than the copy into it (64 MiB: 46 ms fresh, 8 ms warm here;
// docs/performance.md). Called once at start (gradwire-server, the load tool), it turns the
// mappings off (M_MMAP_MAX 0) and raises the trim threshold, so freed blocks stay in the heap for
// the next request; TrimHeap then gives free pages back when the server is idle. False where the
// C library has no mallopt (nothing changed).
bool RetainLargeBlocks();

// Host memory for a large buffer that is reused (gather buffers, scratch): 2 MiB aligned and
// advised as transparent huge pages from 4 MiB up, so its first touch faults once per 2 MiB instead
// of once per 4 KiB; free with FreeHostBuffer. Null when out of memory.
void* AllocateHostBuffer(size_t bytes);
void FreeHostBuffer(void* p);

// Releases the free pages of every malloc arena to the OS (malloc_trim(0)) and reports the
// process RSS before and after. With release_scratch, the CPU backend's free scratch buffers
// (kernels/cpu/scratch.h) go first: when the server is idle; under load they are what the next
// call reuses. Safe to call from any thread at any time; it takes each arena's
// lock in turn, so allocations in that arena wait for the walk (a few ms for a 200 MB heap).
HeapTrimResult TrimHeap(bool release_scratch = false);

// The resident set size of this process, from /proc/self/statm; -1 when unavailable.
int64_t ProcessRssBytes();

}  // namespace gradwire::core
