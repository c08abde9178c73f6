#include "gradwire/kernels/cpu/blas.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <climits>

#include "gradwire/kernels/cpu/parallel.h"

namespace gradwire::kernels::cpu {
namespace {

// The Fortran BLAS entry point (column-major), as every BLAS exports it.
using SgemmFn = void (*)(const char* transa, const char* transb, const int* m, const int* n,
                         const int* k, const float* alpha, const float* a, const int* lda,
                         const float* b, const int* ldb, const float* beta, float* c,
                         const int* ldc);
using SetThreadsFn = void (*)(int);
using ConfigFn = const char* (*)();

struct Blas {
  SgemmFn sgemm = nullptr;
  SetThreadsFn set_threads = nullptr;  // OpenBLAS's openblas_set_num_threads
  ConfigFn config = nullptr;           // OpenBLAS's openblas_get_config
};

const Blas& Loaded() {
  static const Blas blas = [] {
    Blas b;
    b.sgemm = reinterpret_cast<SgemmFn>(dlsym(RTLD_DEFAULT, "sgemm_"));
    b.set_threads = reinterpret_cast<SetThreadsFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
    b.config = reinterpret_cast<ConfigFn>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
    return b;
  }();
  return blas;
}

std::atomic<GemmThreads> g_mode{GemmThreads::kPool};

// One column-major call for the row-major product (C^T = op(B)^T op(A)^T).
void Call(const Blas& blas, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
          float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
          float* c, int64_t ldc) {
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const int im = int(m), in = int(n), ik = int(k), ilda = int(lda), ildb = int(ldb),
            ildc = int(ldc);
  blas.sgemm(&tb, &ta, &in, &im, &ik, &alpha, b, &ildb, a, &ilda, &beta, c, &ildc);
}

}  // namespace

bool BlasAvailable() { return Loaded().sgemm != nullptr; }

std::string BlasDescription() {
  const Blas& blas = Loaded();
  if (blas.sgemm == nullptr) return "none";
  if (blas.config != nullptr) return blas.config();  // "OpenBLAS 0.3.21 ... Cooperlake ..."
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(blas.sgemm), &info) != 0 && info.dli_fname != nullptr) {
    return info.dli_fname;
  }
  return "sgemm_ (unknown library)";
}

void SetGemmThreads(GemmThreads mode) {
  g_mode.store(mode);
  const Blas& blas = Loaded();
  if (blas.set_threads != nullptr) blas.set_threads(mode == GemmThreads::kPool ? 1 : Threads());
}

GemmThreads GetGemmThreads() { return g_mode.load(); }

bool Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const Blas& blas = Loaded();
  if (blas.sgemm == nullptr) return false;
  if (m <= 0 || n <= 0) return true;
  const int64_t limit = INT_MAX;
  if (m > limit || n > limit || k > limit || lda > limit || ldb > limit || ldc > limit) {
    return false;  // the Fortran interface takes int; the caller falls back
  }
  if (k <= 0) {  // C = beta * C (BLAS does this too, but not every BLAS accepts k == 0)
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    }
    return true;
  }
  if (g_mode.load(std::memory_order_relaxed) == GemmThreads::kBlas) {
    Call(blas, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return true;
  }
  // Blocks of C's rows or columns (the longer side), each big enough to pay for a thread: about
  // 2 MFLOP and at least 16 rows or columns.
  const bool split_rows = m >= n;
  const int64_t split = split_rows ? m : n, other = split_rows ? n : m;
  const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 20) / std::max<int64_t>(1, other * k));
  ParallelFor(split, grain, [&](int64_t s0, int64_t s1) {
    if (split_rows) {
      const float* a0 = trans_a ? a + s0 : a + s0 * lda;
      Call(blas, trans_a, trans_b, s1 - s0, n, k, alpha, a0, lda, b, ldb, beta, c + s0 * ldc, ldc);
    } else {
      const float* b0 = trans_b ? b + s0 * ldb : b + s0;
      Call(blas, trans_a, trans_b, m, s1 - s0, k, alpha, a, lda, b0, ldb, beta, c + s0, ldc);
    }
  });
  return true;
}

}  // namespace gradwire::kernels::cpu
