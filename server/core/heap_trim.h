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

#include <cstdint>

namespace gradwire::core {

struct HeapTrimResult {
  bool supported = false;  // false without glibc's malloc_trim (then nothing was done)
  int64_t rss_before_bytes = -1;
  int64_t rss_after_bytes = -1;
  double seconds = 0;  // time spent in malloc_trim
};

// Releases the free pages of every malloc arena to the OS (malloc_trim(0)) and reports the
// process RSS before and after. Safe to call from any thread at any time; it takes each arena's
// lock in turn, so allocations in that arena wait for the walk (a few ms for a 200 MB heap).
HeapTrimResult TrimHeap();

// The resident set size of this process, from /proc/self/statm; -1 when unavailable.
int64_t ProcessRssBytes();

}  // namespace gradwire::core
