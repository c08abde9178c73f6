// The micro-kernel and the loops around it (ordered_gemm.h), included by one source file per
// instruction set (ordered_gemm_avx512.cc, _avx2.cc, ordered_gemm.cc for the baseline), each
// compiled with its own target flags. Everything here has internal linkage, so the copies never
// merge at link time. The per-element arithmetic is written once, here: only the number of
// registers, and so the tile, differs between the copies.
#pragma once

#include <algorithm>
#include <type_traits>

#if defined(__FMA__)
#include <immintrin.h>
#endif

#include "gradwire/kernels/cpu/ordered_gemm.h"
#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/cpu/scratch.h"

namespace gradwire::kernels::cpu {
namespace {

// Eight floats (GCC/clang vector extensions: element-wise IEEE arithmetic; one ymm register with
// AVX2 or AVX-512VL, two xmm on the baseline). U8 loads and stores at float alignment.
typedef float V8 __attribute__((vector_size(32)));
typedef float U8 __attribute__((vector_size(32), aligned(4), may_alias));

inline V8 Load8(const float* p) { return *reinterpret_cast<const U8*>(p); }
inline void Store8(float* p, V8 v) { *reinterpret_cast<U8*>(p) = v; }

// Eight 32-bit words, and the same at bf16 alignment for loads from a panel.
typedef uint32_t W8 __attribute__((vector_size(32)));
typedef uint32_t UW8 __attribute__((vector_size(32), aligned(2), may_alias));

// One row of a panel (16 bf16 values, interleaved as ordered_gemm.h says) widened to its two
// halves of fp32 values: the even words shifted up are columns 0-7, the odd words with the low
// half cleared are columns 8-15. A bf16 value's bits are the upper half of its fp32 value's, so
// the widening is exact.
inline void LoadPanelRow(const uint16_t* p, V8& lo, V8& hi) {
  const W8 w = *reinterpret_cast<const UW8*>(p);
  lo = V8(w << 16);
  hi = V8(w & 0xFFFF0000u);
}

// acc + a * b, lane by lane. The product of two decoded FP8 values is exact in fp32, so the fused
// form and the separate multiply and add round the same: one rounding, the sum's.
inline V8 MulAdd(V8 acc, float a, V8 b) {
#if defined(__FMA__)
  return V8(_mm256_fmadd_ps(_mm256_set1_ps(a), __m256(b), __m256(acc)));
#else
  return acc + a * b;
#endif
}

constexpr int kVecs = int(kPanelWidth / 8);  // V8 registers per panel row
static_assert(kVecs == 2, "a panel row widens to two V8 halves (LoadPanelRow)");

// Where a tile's sums start and end when k is walked in blocks: the first block starts them at
// +0, a later one reloads them from `partial` (stored there exactly, as fp32), and every block but
// the last stores them back. Only the last block applies the epilogue to C. A sum is the same
// chain of adds, in the same order, whether its k range is walked at once or in blocks.
struct Block {
  int64_t k0 = 0, k1 = 0;
  float* partial = nullptr;  // the tile's first sum; row r at partial + r * ldp
  int64_t ldp = 0;
  bool first = true, last = true;
};

// `p` moved by `offset` floats; null stays null (no sums kept when k is walked at once).
inline float* At(float* p, int64_t offset) { return p != nullptr ? p + offset : nullptr; }

// Rows i0 .. i0 + MR - 1 of C against panels p0 .. p0 + NP - 1, over k in [blk.k0, blk.k1):
// MR x NP * kVecs registers of sums, each lane one element of C, added in increasing k. `ap` is
// these rows of A packed for the block: [k1 - k0][MR], so the step at k reads MR consecutive
// floats (one stream, where the rows themselves, a power of two apart, would fight over cache
// sets).
template <int MR, int NP>
inline void Tile(const OrderedGemmArgs& g, int64_t i0, int64_t p0, const Block& blk,
                 const float* ap) {
  V8 acc[MR][NP * kVecs];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < NP * kVecs; ++v) {
      acc[r][v] = blk.first ? V8{} : Load8(blk.partial + r * blk.ldp + v * 8);
    }
  }
  const int64_t depth = g.b.k;
  const uint16_t* b[NP];
#pragma GCC unroll 16
  for (int p = 0; p < NP; ++p) b[p] = g.b.data + (p0 + p) * depth * kPanelWidth;
  const float* a = ap - blk.k0 * MR;
  // Four steps of k per trip: fewer loop instructions between the FMAs.
#pragma GCC unroll 4
  for (int64_t k = blk.k0; k < blk.k1; ++k) {
    V8 bv[NP * kVecs];
#pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) LoadPanelRow(b[p] + k * kPanelWidth, bv[2 * p], bv[2 * p + 1]);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const float av = a[k * MR + r];
#pragma GCC unroll 16
      for (int v = 0; v < NP * kVecs; ++v) acc[r][v] = MulAdd(acc[r][v], av, bv[v]);
    }
  }
  if (!blk.last) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 16
      for (int v = 0; v < NP * kVecs; ++v) Store8(blk.partial + r * blk.ldp + v * 8, acc[r][v]);
    }
    return;
  }
  // The epilogue, element for element as the reference: [c +] (sum * scale [+ bias]).
  const int64_t n = g.b.n;
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    float* crow = g.c + (i0 + r) * g.ldc;
    const float scale = g.row_scale != nullptr ? g.row_scale[i0 + r] : g.scale;
#pragma GCC unroll 16
    for (int v = 0; v < NP * kVecs; ++v) {
      const int64_t j = p0 * kPanelWidth + v * 8;
      if (j >= n) break;
      if (j + 8 <= n) {
        V8 value = acc[r][v] * scale;
        if (g.bias != nullptr) value += Load8(g.bias + j);
        Store8(crow + j, g.accumulate ? Load8(crow + j) + value : value);
      } else {
        // Through a copy: indexing the register by a variable lane would keep every sum in
        // memory for the whole loop above.
        float lanes[8];
        Store8(lanes, acc[r][v]);
        for (int64_t l = 0; j + l < n; ++l) {
          float value = lanes[l] * scale;
          if (g.bias != nullptr) value += g.bias[j + l];
          crow[j + l] = g.accumulate ? crow[j + l] + value : value;
        }
      }
    }
  }
}

// The registers a copy keeps its sums in, and the rows of its main tile.
template <int kSumRegisters, int kRows>
struct Kernel {
  // Panels per tile of R rows: as many as the sum registers allow, so that even one row keeps
  // enough independent sums in flight to hide the add's latency.
  template <int R>
  static constexpr int Panels() {
    return std::max(1, kSumRegisters / (R * kVecs));
  }

  // Rows [i0, i0 + R) against panels [p0, p1): tiles of Panels<R>() panels, then single ones.
  // `blk.partial` is row i0's sums at panel p0.
  template <int R>
  static void Rows(const OrderedGemmArgs& g, int64_t i0, int64_t p0, int64_t p1, Block blk,
                   const float* ap) {
    constexpr int kNp = Panels<R>();
    float* const partial = blk.partial;
    int64_t p = p0;
    for (; p + kNp <= p1; p += kNp) {
      blk.partial = At(partial, (p - p0) * kPanelWidth);
      Tile<R, kNp>(g, i0, p, blk, ap);
    }
    for (; p < p1; ++p) {
      blk.partial = At(partial, (p - p0) * kPanelWidth);
      Tile<R, 1>(g, i0, p, blk, ap);
    }
  }

  // The rows left under a main tile (1 .. kRows - 1 of them) against panels [p0, p1).
  template <int R = 1>
  static void EdgeRows(const OrderedGemmArgs& g, int r, int64_t i0, int64_t p0, int64_t p1,
                       const Block& blk, const float* ap) {
    if constexpr (R < kRows) {
      if (r == R) return Rows<R>(g, i0, p0, p1, blk, ap);
      EdgeRows<R + 1>(g, r, i0, p0, p1, blk, ap);
    }
  }

  // Rows [c0, c1) of A over k in [k0, k1) packed into `out` tile by tile: each group of kRows
  // rows (the last group: what is left) as [k1 - k0][rows].
  static void PackA(const OrderedGemmArgs& g, int64_t c0, int64_t c1, int64_t k0, int64_t k1,
                    float* out) {
    const int64_t kb = k1 - k0;
    const float* table = g.a_codes != nullptr ? DecodeTable(g.a_format) : nullptr;
    for (int64_t i = c0; i < c1; i += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, c1 - i);
      float* tile = out + (i - c0) * kb;
      for (int64_t r = 0; r < rows; ++r) {
        if (table != nullptr) {
          const uint8_t* row = g.a_codes + (i + r) * g.lda + k0;
          for (int64_t k = 0; k < kb; ++k) tile[k * rows + r] = table[row[k]];
        } else {
          const float* row = g.a + (i + r) * g.lda + k0;
          for (int64_t k = 0; k < kb; ++k) tile[k * rows + r] = row[k];
        }
      }
    }
  }

  // Rows [c0, c1) against panels [p0, p1) over one block of k: main tiles, then the edge rows.
  // `blk.partial` is row c0's sums at panel p0. `packed` is these rows of A over the block, as
  // PackA leaves them. Panels outer, tiles inner: a panel's slice of B stays in L1 while every
  // main tile of the chunk passes over it. A shallow block (a weight gradient over a few rows) is
  // mostly the epilogue's traffic to C instead: tiles outer then, so C is walked row by row.
  static void Chunk(const OrderedGemmArgs& g, int64_t c0, int64_t c1, int64_t p0, int64_t p1,
                    Block blk, const float* packed) {
    const int64_t kb = blk.k1 - blk.k0;
    const int64_t full = c0 + (c1 - c0) / kRows * kRows;
    float* const partial = blk.partial;
    if (kb < kShallow) {
      for (int64_t i = c0; i < full; i += kRows) {
        blk.partial = At(partial, (i - c0) * blk.ldp);
        Rows<kRows>(g, i, p0, p1, blk, packed + (i - c0) * kb);
      }
    } else {
      constexpr int kNp = Panels<kRows>();
      auto tiles = [&](int64_t p, auto np) {
        for (int64_t i = c0; i < full; i += kRows) {
          blk.partial = At(partial, (i - c0) * blk.ldp + (p - p0) * kPanelWidth);
          Tile<kRows, decltype(np)::value>(g, i, p, blk, packed + (i - c0) * kb);
        }
      };
      int64_t p = p0;
      for (; p + kNp <= p1; p += kNp) tiles(p, std::integral_constant<int, kNp>());
      for (; p < p1; ++p) tiles(p, std::integral_constant<int, 1>());
    }
    blk.partial = At(partial, (full - c0) * blk.ldp);
    if (full < c1) EdgeRows(g, int(c1 - full), full, p0, p1, blk, packed + (full - c0) * kb);
  }

  // The depth of a block of k when k is walked in blocks: a panel's slice of it (kKc x 16
  // bf16 values, 8 KiB) stays in L1 while every tile of a chunk of rows passes over it.
  static constexpr int64_t kKc = 256;
  // Blocks shallower than this walk C row by row (Chunk).
  static constexpr int64_t kShallow = 64;
  // Panels of B per column block when k is walked in blocks: 256 columns, so that a block of B
  // (256 x all of k, 2 MiB at k = 4096) stays in L3 while every chunk of rows passes over it,
  // and a chunk's sums (kBlockedRows x 256 floats) stay in L2.
  static constexpr int64_t kNcPanels = 16;
  // Rows of A per chunk: all of k for a chunk of at most kChunkFloats floats when k is walked at
  // once; kBlockedRows rows when it is walked in blocks (a block's slice, kKc of k: 96 KiB, in
  // L2).
  static constexpr int64_t kChunkFloats = 48 * 1024;
  static constexpr int64_t kBlockedRows = 16 * kRows;

  // Rows [i0, i1) against panels [p0, p1), a chunk of rows of A at a time. Deep products with
  // rows enough to reuse each slice of B (more than two main tiles) walk k in blocks of kKc,
  // keeping the sums between blocks in a scratch buffer.
  static void Range(const OrderedGemmArgs& g, int64_t i0, int64_t i1, int64_t p0, int64_t p1) {
    const int64_t depth = g.b.k;
    if (depth <= 2 * kKc || i1 - i0 < 4 * kRows) {
      const int64_t per_chunk = std::max<int64_t>(1, kChunkFloats / std::max<int64_t>(1, depth));
      const int64_t chunk = std::min(i1 - i0, std::max<int64_t>(kRows, per_chunk / kRows * kRows));
      Scratch packed = TakeScratch(size_t(chunk * depth) * sizeof(float));
      for (int64_t c0 = i0; c0 < i1; c0 += chunk) {
        const int64_t c1 = std::min(i1, c0 + chunk);
        PackA(g, c0, c1, 0, depth, packed.floats());
        Chunk(g, c0, c1, p0, p1, Block{0, depth, nullptr, 0, true, true}, packed.floats());
      }
      return;
    }
    // A chunk of rows is packed once, block of k after block of k (block k0 at (c1 - c0) * k0),
    // and then runs against every column block of B, so A is decoded once whatever n is. B
    // streams once per chunk of rows: sequential panels, read at a small fraction of the time
    // the chunk's products take.
    const int64_t width = std::min(p1 - p0, kNcPanels) * kPanelWidth;
    const int64_t chunk = std::min(kBlockedRows, i1 - i0);
    Scratch sums = TakeScratch(size_t(chunk * width) * sizeof(float));
    Scratch packed = TakeScratch(size_t(chunk * depth) * sizeof(float));
    for (int64_t c0 = i0; c0 < i1; c0 += chunk) {
      const int64_t c1 = std::min(i1, c0 + chunk);
      for (int64_t k0 = 0; k0 < depth; k0 += kKc) {
        PackA(g, c0, c1, k0, std::min(depth, k0 + kKc), packed.floats() + (c1 - c0) * k0);
      }
      for (int64_t q0 = p0; q0 < p1; q0 += kNcPanels) {
        const int64_t q1 = std::min(p1, q0 + kNcPanels);
        for (int64_t k0 = 0; k0 < depth; k0 += kKc) {
          const int64_t k1 = std::min(depth, k0 + kKc);
          Chunk(g, c0, c1, q0, q1, Block{k0, k1, sums.floats(), width, k0 == 0, k1 == depth},
                packed.floats() + (c1 - c0) * k0);
        }
      }
    }
  }

  // The split over the pool: by panels when the rows are few (then B is the traffic), by row
  // chunks otherwise. Each element is computed whole by one range either way.
  static void Run(const OrderedGemmArgs& g) {
    const int64_t panels = (g.b.n + kPanelWidth - 1) / kPanelWidth;
    // Work per element: its k products and the epilogue's loads and stores (what a shallow
    // product, a weight gradient over a few rows, mostly costs).
    const double depth = double(std::max<int64_t>(1, g.b.k)) + 16.0;
    constexpr double kGrainFlops = double(1 << 19);
    if (g.m < 4 * kRows * Threads()) {
      const double per_panel = 2.0 * double(g.m) * depth * double(kPanelWidth);
      const int64_t grain = std::max<int64_t>(1, int64_t(kGrainFlops / per_panel));
      ParallelFor(panels, grain, [&](int64_t q0, int64_t q1) { Range(g, 0, g.m, q0, q1); });
    } else {
      const double per_row = 2.0 * double(g.b.n) * depth;
      const int64_t grain = std::max<int64_t>(kRows, int64_t(kGrainFlops / per_row));
      ParallelFor(g.m, grain, [&](int64_t r0, int64_t r1) { Range(g, r0, r1, 0, panels); });
    }
  }
};

}  // namespace
}  // namespace gradwire::kernels::cpu
