// The micro-kernel and the loops around it (ordered_gemm.h), included by one source file per
// instruction set (ordered_gemm_avx512bf16.cc, _avx512.cc, _avx2.cc, and ordered_gemm.cc for the
// baseline), each compiled with its own target flags. Everything here has internal linkage, so
// the copies never merge at link time. The per-element arithmetic is written once, here: a copy
// chooses only its vector width, how a step adds its products (fused multiply-adds of one k, or
// one bf16 dot-product instruction over a pair of k), and so its register tile.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "gradwire/kernels/cpu/ordered_gemm.h"
#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/cpu/scratch.h"

namespace gradwire::kernels::cpu {
namespace {

// Vectors of floats and of 32-bit words (GCC/clang vector extensions: element-wise IEEE
// arithmetic), and the same at 4-byte alignment for loads and stores anywhere.
typedef float V8 __attribute__((vector_size(32)));
typedef float U8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint32_t W8 __attribute__((vector_size(32)));
typedef uint32_t UW8 __attribute__((vector_size(32), aligned(4), may_alias));

// Eight lanes: one ymm register with AVX2 or AVX-512VL, two xmm on the baseline.
struct Lanes8 {
  static constexpr int kLanes = 8;
  using V = V8;
  using W = W8;
  static V Load(const float* p) { return *reinterpret_cast<const U8*>(p); }
  static void Store(float* p, V v) { *reinterpret_cast<U8*>(p) = v; }
  static W LoadWords(const uint16_t* p) { return *reinterpret_cast<const UW8*>(p); }
  // The words with their lower halves cleared. With AVX2 by two shifts, written out because the
  // compiler turns them back into an AND with a mask that would hold one of the 16 registers the
  // tile needs for its sums, panel vectors and broadcast.
  static W UpperHalves(W w) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    asm("vpsrld $16, %0, %0\n\tvpslld $16, %0, %0" : "+x"(w));
    return w;
#else
    return w & 0xFFFF0000u;
#endif
  }
  // acc + a * b, lane by lane. The product of two decoded FP8 values is exact in fp32, so the
  // fused form and the separate multiply and add round the same: one rounding, the sum's.
  static V MulAdd(V acc, float a, V b) {
#if defined(__FMA__)
    return V(_mm256_fmadd_ps(_mm256_set1_ps(a), __m256(b), __m256(acc)));
#else
    return acc + a * b;
#endif
  }
};

#if defined(__AVX512F__)
typedef float V16 __attribute__((vector_size(64)));
typedef float U16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t W16 __attribute__((vector_size(64)));
typedef uint32_t UW16 __attribute__((vector_size(64), aligned(4), may_alias));

// Sixteen lanes: one zmm register.
struct Lanes16 {
  static constexpr int kLanes = 16;
  using V = V16;
  using W = W16;
  static V Load(const float* p) { return *reinterpret_cast<const U16*>(p); }
  static void Store(float* p, V v) { *reinterpret_cast<U16*>(p) = v; }
  static W LoadWords(const uint16_t* p) { return *reinterpret_cast<const UW16*>(p); }
  static W UpperHalves(W w) { return w & 0xFFFF0000u; }
  static V MulAdd(V acc, float a, V b) {
    return V(_mm512_fmadd_ps(_mm512_set1_ps(a), __m512(b), __m512(acc)));
  }
};
#endif

// How a copy adds its products. A step covers one pair of k (2t, 2t + 1) of a panel: the panel
// row pair is one word per column, k = 2t in its upper half and k = 2t + 1 in its lower half
// (ordered_gemm.h).
//
// Fma: A packed as floats, one per row and k; each k of the pair widened from its half of the
// words (a mask or a shift: exact, a bf16 value's bits are the upper half of its fp32 value's)
// and added by a multiply-add, k = 2t first.
template <class L>
struct Fma {
  using Lanes = L;
  static constexpr bool kDot = false;
};

#if defined(__AVX512BF16__)
// Dot: A packed as words of bf16 pairs like the panels (k = 2t upper, 2t + 1 lower), and
// vdpbf16ps adds both products of a lane's pair: by its definition, the upper (odd-numbered)
// element's product first, then the lower one's, each add rounded to nearest even, which is the
// reference's order, k = 2t then 2t + 1. Its flushing of denormal inputs and results changes
// nothing here: decoded FP8 values are at least 2^-16 and every nonzero product and partial sum
// at least 2^-25 in magnitude. OrderedGemmCopySupported also checks these bits on the running
// CPU once before the copy is used.
struct Dot {
  using Lanes = Lanes16;
  static constexpr bool kDot = true;
  static V16 Step(V16 acc, uint32_t a_pair, W16 b_pairs) {
    return V16(_mm512_dpbf16_ps(__m512(acc), (__m512bh)_mm512_set1_epi32(int(a_pair)),
                                (__m512bh)__m512i(b_pairs)));
  }
};
#endif

// 32-bit slots of packed A per row and pair of k: two floats, or one word of a bf16 pair.
template <class Isa>
constexpr int64_t kASlotsPerPair = Isa::kDot ? 1 : 2;

// Where a tile's sums start and end when k is walked in blocks: the first block starts them at
// +0, a later one reloads them from `partial` (stored there exactly, as fp32), and every block but
// the last stores them back. Only the last block applies the epilogue to C. A sum is the same
// chain of adds, in the same order, whether its k range is walked at once or in blocks. Every
// block but the last starts and ends at an even k (kKc is even), so a pair of k is never split.
struct Block {
  int64_t k0 = 0, k1 = 0;
  float* partial = nullptr;  // the tile's first sum; row r at partial + r * ldp
  int64_t ldp = 0;
  bool first = true, last = true;
};

// `p` moved by `offset` floats; null stays null (no sums kept when k is walked at once).
inline float* At(float* p, int64_t offset) { return p != nullptr ? p + offset : nullptr; }

// Pairs of k in [k0, k1) rounded up: an odd end's pair holds a zero for its missing k, in A and
// in B, and a zero product added to a sum leaves it as it was (a sum that starts at +0 is never
// -0, and x + (+-0) = x for every other x, NaN and inf included).
inline int64_t Pairs(int64_t k) { return (k + 1) / 2; }

// The epilogue of a tile that reaches past the last column: rows [i0, i0 + rows) and columns
// [j0, j0 + cols) of C from their sums (row r at sums + r * ld), element by element.
inline void EdgeEpilogue(const OrderedGemmArgs& g, int64_t i0, int64_t j0, int rows, int64_t cols,
                         const float* sums, int64_t ld) {
  for (int r = 0; r < rows; ++r) {
    float* crow = g.c + (i0 + r) * g.ldc + j0;
    const float scale = g.row_scale != nullptr ? g.row_scale[i0 + r] : g.scale;
    for (int64_t j = 0; j < cols; ++j) {
      float value = sums[r * ld + j] * scale;
      if (g.bias != nullptr) value += g.bias[j0 + j];
      crow[j] = g.accumulate ? crow[j] + value : value;
    }
  }
}

// Rows i0 .. i0 + MR - 1 of C against panels p0 .. p0 + NP - 1, over k in [blk.k0, blk.k1):
// MR x NP * (kPanelWidth / lanes) registers of sums, each lane one element of C, added in
// increasing k. `ap` is these rows of A packed for the block, pair by pair: [pairs][MR] of the
// copy's slots, so a step reads MR consecutive slots (one stream, where the rows themselves, a
// power of two apart, would fight over cache sets).
template <class Isa, int MR, int NP>
inline void Tile(const OrderedGemmArgs& g, int64_t i0, int64_t p0, const Block& blk,
                 const void* ap) {
  using L = typename Isa::Lanes;
  using V = typename L::V;
  using W = typename L::W;
  constexpr int kV = int(kPanelWidth) / L::kLanes;  // vectors per panel column block
  V acc[MR][NP * kV];
#pragma GCC unroll 32
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 32
    for (int v = 0; v < NP * kV; ++v) {
      acc[r][v] = blk.first ? V{} : L::Load(blk.partial + r * blk.ldp + v * L::kLanes);
    }
  }
  const int64_t panel_size = Pairs(g.b.k) * 2 * kPanelWidth;
  const uint16_t* b[NP];
#pragma GCC unroll 32
  for (int p = 0; p < NP; ++p) b[p] = g.b.data + (p0 + p) * panel_size;
  const int64_t t0 = blk.k0 / 2, t1 = Pairs(blk.k1);
  if constexpr (Isa::kDot) {
#if defined(__AVX512BF16__)
    const uint32_t* a = static_cast<const uint32_t*>(ap) - t0 * MR;
#pragma GCC unroll 2
    for (int64_t t = t0; t < t1; ++t) {
      W bv[NP];
#pragma GCC unroll 32
      for (int p = 0; p < NP; ++p) bv[p] = L::LoadWords(b[p] + t * 2 * kPanelWidth);
#pragma GCC unroll 32
      for (int r = 0; r < MR; ++r) {
        const uint32_t av = a[t * MR + r];
#pragma GCC unroll 32
        for (int p = 0; p < NP; ++p) acc[r][p] = Isa::Step(acc[r][p], av, bv[p]);
      }
    }
#endif
  } else {
    const float* a = static_cast<const float*>(ap) - 2 * t0 * MR;
    // One k of the pair: the words' upper halves (k = 2t) or lower halves (k = 2t + 1), loaded
    // again for each half rather than kept: the barrier between the halves stops the compiler
    // from keeping the first half's loads, which would take a register per vector that the
    // 16-register copies do not have.
    auto step = [&](int64_t t, int half) __attribute__((always_inline)) {
      if (half == 1) asm volatile("" ::: "memory");
      V bv[NP * kV];
#pragma GCC unroll 32
      for (int p = 0; p < NP; ++p) {
#pragma GCC unroll 32
        for (int v = 0; v < kV; ++v) {
          const W w = L::LoadWords(b[p] + t * 2 * kPanelWidth + v * 2 * L::kLanes);
          bv[p * kV + v] = half == 0 ? V(L::UpperHalves(w)) : V(w << 16);
        }
      }
      const float* ak = a + (2 * t + half) * MR;
#pragma GCC unroll 32
      for (int r = 0; r < MR; ++r) {
        const float av = ak[r];
#pragma GCC unroll 32
        for (int v = 0; v < NP * kV; ++v) acc[r][v] = L::MulAdd(acc[r][v], av, bv[v]);
      }
    };
#pragma GCC unroll 2
    for (int64_t t = t0; t < t1; ++t) {
      step(t, 0);
      step(t, 1);
    }
  }
  if (!blk.last) {
#pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 32
      for (int v = 0; v < NP * kV; ++v) {
        L::Store(blk.partial + r * blk.ldp + v * L::kLanes, acc[r][v]);
      }
    }
    return;
  }
  // The epilogue, element for element as the reference: [c +] (sum * scale [+ bias]).
  const int64_t n = g.b.n;
  const int64_t j0 = p0 * kPanelWidth;
  if (j0 + NP * kPanelWidth <= n) {
#pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) {
      float* crow = g.c + (i0 + r) * g.ldc + j0;
      const float scale = g.row_scale != nullptr ? g.row_scale[i0 + r] : g.scale;
#pragma GCC unroll 32
      for (int v = 0; v < NP * kV; ++v) {
        V value = acc[r][v] * scale;
        if (g.bias != nullptr) value += L::Load(g.bias + j0 + v * L::kLanes);
        float* out = crow + v * L::kLanes;
        L::Store(out, g.accumulate ? L::Load(out) + value : value);
      }
    }
    return;
  }
  // A tile past the last column: its sums through a copy, then the columns that exist one by
  // one (indexing the registers by a variable lane would keep every sum in memory for the whole
  // loop above).
  float sums[MR][NP * kPanelWidth];
#pragma GCC unroll 32
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 32
    for (int v = 0; v < NP * kV; ++v) L::Store(&sums[r][v * L::kLanes], acc[r][v]);
  }
  EdgeEpilogue(g, i0, j0, MR, std::min<int64_t>(NP * kPanelWidth, n - j0), &sums[0][0],
               NP * kPanelWidth);
}

// A copy: how its steps add (Isa), the registers it keeps its sums in, and the rows of its main
// tile.
template <class Isa, int kSumRegisters, int kRows>
struct Kernel {
  static constexpr int kV = int(kPanelWidth) / Isa::Lanes::kLanes;
  static constexpr int64_t kSlots = kASlotsPerPair<Isa>;

  // Panels per tile of R rows: as many as the sum registers allow, so that even one row keeps
  // enough independent sums in flight to hide the add's latency.
  template <int R>
  static constexpr int Panels() {
    return std::max(1, kSumRegisters / (R * kV));
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
      Tile<Isa, R, kNp>(g, i0, p, blk, ap);
    }
    for (; p < p1; ++p) {
      blk.partial = At(partial, (p - p0) * kPanelWidth);
      Tile<Isa, R, 1>(g, i0, p, blk, ap);
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

  // Slots of packed A that `rows` rows over a block of `kb` k take.
  static int64_t PackedSlots(int64_t rows, int64_t kb) { return rows * Pairs(kb) * kSlots; }

  // Rows [c0, c1) of A over k in [k0, k1) packed into `out` tile by tile: each group of kRows
  // rows (the last group: what is left) as [pairs][rows] of the copy's slots, an odd end's
  // missing k as zero.
  static void PackA(const OrderedGemmArgs& g, int64_t c0, int64_t c1, int64_t k0, int64_t k1,
                    float* out) {
    const int64_t kb = k1 - k0, pairs = Pairs(kb);
    const float* table = g.a_codes != nullptr ? DecodeTable(g.a_format) : nullptr;
    // Block-scaled codes: the scale of each k of the block row being packed (rebuilt when the
    // row enters another block row), so that no k divides.
    const bool blocked = table != nullptr && g.a_block_scale != nullptr;
    Scratch kscale_lease;
    float* kscale = nullptr;
    int64_t built = -1;
    if (blocked) {
      kscale_lease = TakeScratch(size_t(kb) * sizeof(float));
      kscale = kscale_lease.floats();
    }
    for (int64_t i = c0; i < c1; i += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, c1 - i);
      float* tile = out + PackedSlots(i - c0, kb);
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* codes = table != nullptr ? g.a_codes + (i + r) * g.lda + k0 : nullptr;
        const float* values = table == nullptr ? g.a + (i + r) * g.lda + k0 : nullptr;
        if (blocked && (i + r) / g.a_block.rows != built) {
          built = (i + r) / g.a_block.rows;
          const float* grid = g.a_block_scale + built * g.a_block_ld;
          for (int64_t k = k0; k < k1;) {
            const int64_t bj = k / g.a_block.cols;
            const int64_t end = std::min(k1, (bj + 1) * g.a_block.cols);
            std::fill(kscale + (k - k0), kscale + (end - k0), grid[bj]);
            k = end;
          }
        }
        auto value = [&](int64_t k) {
          if (codes == nullptr) return values[k];
          return blocked ? table[codes[k]] * kscale[k] : table[codes[k]];
        };
        if constexpr (Isa::kDot) {
          // A decoded FP8 value is exact in bf16: its upper half (OrderedGemmUsing checks a
          // float A before it takes this copy).
          auto upper = [](float v) { return __builtin_bit_cast(uint32_t, v) & 0xFFFF0000u; };
          uint32_t* words = reinterpret_cast<uint32_t*>(tile);
          for (int64_t t = 0; t < pairs; ++t) {
            const uint32_t hi = upper(value(2 * t));
            const uint32_t lo = 2 * t + 1 < kb ? upper(value(2 * t + 1)) >> 16 : 0u;
            words[t * rows + r] = hi | lo;
          }
        } else {
          for (int64_t k = 0; k < kb; ++k) tile[k * rows + r] = value(k);
          if (kb % 2 != 0) tile[kb * rows + r] = 0.0f;
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
        Rows<kRows>(g, i, p0, p1, blk, packed + PackedSlots(i - c0, kb));
      }
    } else {
      constexpr int kNp = Panels<kRows>();
      auto tiles = [&](int64_t p, auto np) {
        for (int64_t i = c0; i < full; i += kRows) {
          blk.partial = At(partial, (i - c0) * blk.ldp + (p - p0) * kPanelWidth);
          Tile<Isa, kRows, decltype(np)::value>(g, i, p, blk, packed + PackedSlots(i - c0, kb));
        }
      };
      int64_t p = p0;
      for (; p + kNp <= p1; p += kNp) tiles(p, std::integral_constant<int, kNp>());
      for (; p < p1; ++p) tiles(p, std::integral_constant<int, 1>());
    }
    blk.partial = At(partial, (full - c0) * blk.ldp);
    if (full < c1) {
      EdgeRows(g, int(c1 - full), full, p0, p1, blk, packed + PackedSlots(full - c0, kb));
    }
  }

  // The depth of a block of k when k is walked in blocks (even, so that no block but the last
  // ends inside a pair): a panel's slice of it (kKc x 16 bf16 values, 8 KiB) stays in L1 while
  // every tile of a chunk of rows passes over it.
  static constexpr int64_t kKc = 256;
  static_assert(kKc % 2 == 0, "a block of k holds whole pairs");
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
      Scratch packed = TakeScratch(size_t(PackedSlots(chunk, depth)) * sizeof(float));
      for (int64_t c0 = i0; c0 < i1; c0 += chunk) {
        const int64_t c1 = std::min(i1, c0 + chunk);
        PackA(g, c0, c1, 0, depth, packed.floats());
        Chunk(g, c0, c1, p0, p1, Block{0, depth, nullptr, 0, true, true}, packed.floats());
      }
      return;
    }
    // A chunk of rows is packed once, block of k after block of k (block k0 at the slots of
    // k0 of every row before it), and then runs against every column block of B, so A is decoded
    // once whatever n is. B streams once per chunk of rows: sequential panels, read at a small
    // fraction of the time the chunk's products take.
    const int64_t width = std::min(p1 - p0, kNcPanels) * kPanelWidth;
    const int64_t chunk = std::min(kBlockedRows, i1 - i0);
    Scratch sums = TakeScratch(size_t(chunk * width) * sizeof(float));
    Scratch packed = TakeScratch(size_t(PackedSlots(chunk, depth)) * sizeof(float));
    for (int64_t c0 = i0; c0 < i1; c0 += chunk) {
      const int64_t c1 = std::min(i1, c0 + chunk);
      for (int64_t k0 = 0; k0 < depth; k0 += kKc) {
        PackA(g, c0, c1, k0, std::min(depth, k0 + kKc), packed.floats() + PackedSlots(c1 - c0, k0));
      }
      for (int64_t q0 = p0; q0 < p1; q0 += kNcPanels) {
        const int64_t q1 = std::min(p1, q0 + kNcPanels);
        for (int64_t k0 = 0; k0 < depth; k0 += kKc) {
          const int64_t k1 = std::min(depth, k0 + kKc);
          Chunk(g, c0, c1, q0, q1, Block{k0, k1, sums.floats(), width, k0 == 0, k1 == depth},
                packed.floats() + PackedSlots(c1 - c0, k0));
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
