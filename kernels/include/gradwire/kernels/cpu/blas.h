// Row-major fp32 GEMM for the CPU backend on the BLAS the process already has (libtorch's: OpenBLAS
// on Debian), found at run time, so kernels/ links no BLAS and no torch.
//
// Who splits a GEMM over the cores is a choice (GemmThreads): by default the backend's own pool
// (parallel.h) calls BLAS single-threaded on blocks of C, so one set of threads serves the GEMMs
// and every other loop; kBlas leaves the split to BLAS's own threads (OpenBLAS's pthreads), which
// then compete with the pool for the cores. docs/performance.md has the measurement that chose
// the default.
#pragma once

#include <cstdint>
#include <string>

namespace gradwire::kernels::cpu {

enum class GemmThreads {
  kPool,  // blocks of C on the pool, BLAS single-threaded (the default)
  kBlas,  // one BLAS call, BLAS's own threads (as many as the pool has)
};

// True when a BLAS sgemm was found in the process.
bool BlasAvailable();
// What was found: OpenBLAS's own configuration string ("OpenBLAS 0.3.21 DYNAMIC_ARCH ... Cooperlake
// ..."), the library's path for another BLAS, or "none".
std::string BlasDescription();

// Sets who splits the GEMMs (and BLAS's own thread count to match: 1 for kPool, the pool's size
// for kBlas). Call it after SetThreads.
void SetGemmThreads(GemmThreads mode);
GemmThreads GetGemmThreads();

// C[m, n] = alpha * op(A) . op(B) + beta * C, all row-major: op(A) is [m, k] (A stored [k, m]
// when trans_a), op(B) is [k, n] (B stored [n, k] when trans_b); lda/ldb/ldc are the row strides
// of A, B, C as stored. beta == 0 ignores C's old contents. False (nothing computed) when no BLAS
// is available. Each element of C is computed by one BLAS call, so its summation order does not
// depend on the split.
bool Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace gradwire::kernels::cpu
