// The CPU backend's one thread pool. Every host loop of the CPU backend (casts, decodes,
// accumulations) and its GEMMs (BLAS called single-threaded on blocks of the output) run on it, so
// no second pool (OpenMP's, OpenBLAS's) spins against it for the same cores
// (docs/performance.md, "One thread pool").
//
// The thread that calls ParallelFor takes part in the work; the pool adds Threads() - 1 workers
// that sleep between jobs. One job runs at a time: a call made while another thread's job runs, or
// from inside a job, runs serially on the calling thread, so nesting and concurrent callers never
// deadlock and never oversubscribe the cores.
#pragma once

#include <cstdint>
#include <functional>

namespace gradwire::kernels::cpu {

// The most threads a job runs on.
inline constexpr int kMaxThreads = 256;

// Sets the threads a job runs on, the caller included (0: one per core; at most kMaxThreads).
// Waits for a running job.
void SetThreads(int threads);
// The threads a job runs on, the caller included (>= 1).
int Threads();

// Calls fn(begin, end) on disjoint ranges covering [0, n), in at most Threads() contiguous ranges
// of at least `grain` elements (one range, on the caller, when n < 2 * grain). The split depends
// only on n, grain and Threads(), never on timing. Returns when every range is done; an exception
// thrown by fn is rethrown here (the first one) after the others finish.
void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// As ParallelFor, and fn also gets the index of its range (0 .. Ranges(n, grain) - 1), for
// per-range partial results.
void ParallelForRanges(int64_t n, int64_t grain,
                       const std::function<void(int64_t range, int64_t begin, int64_t end)>& fn);

// The number of ranges ParallelFor(n, grain, ...) uses now.
int64_t Ranges(int64_t n, int64_t grain);

}  // namespace gradwire::kernels::cpu
