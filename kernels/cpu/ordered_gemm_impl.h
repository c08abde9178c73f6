// The row-invariant GEMM's body (ordered_gemm.h), included by one source file per instruction set
// (ordered_gemm_avx512.cc, _avx2.cc, _base.cc), each compiled with its own target flags. Everything
// here has internal linkage, so the copies never merge at link time. The per-element arithmetic is
// written once, here, and is the same in every copy; only the vector width and the rows per tile
// differ.
#pragma once

#include <algorithm>

#include "gradwire/kernels/cpu/ordered_gemm.h"
#include "gradwire/kernels/cpu/parallel.h"

namespace gradwire::kernels::cpu {
namespace {

// Eight floats, one per lane of the reference's sum (GCC/clang vector extensions: element-wise
// IEEE arithmetic; one ymm register with AVX2 or AVX-512, two xmm on the baseline). U loads at
// float alignment.
typedef float V8 __attribute__((vector_size(32)));
typedef float U8 __attribute__((vector_size(32), aligned(4), may_alias));

inline V8 Load8(const float* p) { return *reinterpret_cast<const U8*>(p); }

// The reference's final sum of the eight lanes, in its order.
inline float Combine(V8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// Rows i0 .. i0 + MR - 1 of C at columns j0 .. j0 + NJ - 1: one vector of eight lane sums per
// element, a = A's rows and b = B's rows ([n, k]: contiguous along k, as the reference reads
// them), added in increasing k. The k % 8 products left over go to lanes 0 .. k % 8 - 1, as in
// the reference: the other lanes add 0 * 0 = +0, which changes no sum (a lane is never -0: it
// starts at +0, and x + y is -0 only when both are).
template <int MR, int NJ>
inline void Tile(const OrderedGemmArgs& g, int64_t i0, int64_t j0) {
  V8 acc[MR][NJ];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NJ; ++c) acc[r][c] = V8{};
  }
  const float* a[MR];
  const float* b[NJ];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) a[r] = g.a + (i0 + r) * g.lda;
#pragma GCC unroll 8
  for (int c = 0; c < NJ; ++c) b[c] = g.b + (j0 + c) * g.ldb;
  int64_t k = 0;
  for (; k + 8 <= g.k; k += 8) {
    V8 av[MR], bv[NJ];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) av[r] = Load8(a[r] + k);
#pragma GCC unroll 8
    for (int c = 0; c < NJ; ++c) bv[c] = Load8(b[c] + k);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NJ; ++c) acc[r][c] += av[r] * bv[c];
    }
  }
  if (k < g.k) {
    V8 av[MR], bv[NJ];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      av[r] = V8{};
      for (int64_t l = 0; k + l < g.k; ++l) av[r][l] = a[r][k + l];
    }
#pragma GCC unroll 8
    for (int c = 0; c < NJ; ++c) {
      bv[c] = V8{};
      for (int64_t l = 0; k + l < g.k; ++l) bv[c][l] = b[c][k + l];
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < NJ; ++c) acc[r][c] += av[r] * bv[c];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float* crow = g.c + (i0 + r) * g.ldc + j0;
    const float scale = g.row_scale != nullptr ? g.row_scale[i0 + r] : g.scale;
#pragma GCC unroll 8
    for (int c = 0; c < NJ; ++c) {
      float value = Combine(acc[r][c]) * scale;
      if (g.bias != nullptr) value += g.bias[j0 + c];
      crow[c] = g.accumulate ? crow[c] + value : value;
    }
  }
}

// At most this many floats of A (a chunk of rows) stay in cache while the range's rows of B pass
// over them.
constexpr int64_t kChunkFloats = 32 * 1024;

// The rows of one chunk of A against columns [j0, j1) in tiles of MR x NJ, smaller tiles at the
// edges.
template <int MR, int NJ>
inline void Columns(const OrderedGemmArgs& g, int64_t c0, int64_t c1, int64_t j0, int64_t j1) {
  int64_t j = j0;
  for (; j + NJ <= j1; j += NJ) {
    int64_t i = c0;
    for (; i + MR <= c1; i += MR) Tile<MR, NJ>(g, i, j);
    for (; i < c1; ++i) Tile<1, NJ>(g, i, j);
  }
  for (; j < j1; ++j) {
    int64_t i = c0;
    for (; i + MR <= c1; i += MR) Tile<MR, 1>(g, i, j);
    for (; i < c1; ++i) Tile<1, 1>(g, i, j);
  }
}

template <int MR, int NJ>
void Range(const OrderedGemmArgs& g, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  const int64_t chunk = std::max<int64_t>(MR, kChunkFloats / std::max<int64_t>(1, g.k));
  for (int64_t c0 = i0; c0 < i1; c0 += chunk) {
    Columns<MR, NJ>(g, c0, std::min(i1, c0 + chunk), j0, j1);
  }
}

// The split over the pool: by columns when the rows are few (then B is the traffic), by row
// chunks otherwise. Each element is computed whole by one range either way.
template <int MR, int NJ>
void Split(const OrderedGemmArgs& g) {
  const double depth = double(std::max<int64_t>(1, g.k));
  constexpr double kGrainFlops = double(1 << 21);  // about a millisecond's work, at least
  if (g.m < 4 * MR * Threads()) {
    const int64_t grain = std::max<int64_t>(NJ, int64_t(kGrainFlops / (2.0 * double(g.m) * depth)));
    ParallelFor(g.n, grain, [&](int64_t j0, int64_t j1) { Range<MR, NJ>(g, 0, g.m, j0, j1); });
  } else {
    const int64_t grain = std::max<int64_t>(MR, int64_t(kGrainFlops / (2.0 * double(g.n) * depth)));
    ParallelFor(g.m, grain, [&](int64_t i0, int64_t i1) { Range<MR, NJ>(g, i0, i1, 0, g.n); });
  }
}

}  // namespace
}  // namespace gradwire::kernels::cpu
