#include "server/core/heap_trim.h"

#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>

#include "gradwire/kernels/cpu/scratch.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace gradwire::core {

int64_t ProcessRssBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  if (n != 2) return -1;
  return int64_t(resident) * int64_t(sysconf(_SC_PAGESIZE));
}

void* AllocateHostBuffer(size_t bytes) { return kernels::cpu::AllocateHostBuffer(bytes); }

void FreeHostBuffer(void* p) { kernels::cpu::FreeHostBuffer(p); }

bool RetainLargeBlocks() {
#if defined(__GLIBC__)
  return mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
#else
  return false;
#endif
}

HeapTrimResult TrimHeap(bool release_scratch) {
  HeapTrimResult r;
  r.rss_before_bytes = ProcessRssBytes();
  if (release_scratch) kernels::cpu::ReleaseScratch();
#if defined(__GLIBC__)
  r.supported = true;
  const auto start = std::chrono::steady_clock::now();
  malloc_trim(0);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
#endif
  r.rss_after_bytes = ProcessRssBytes();
  return r;
}

}  // namespace gradwire::core
