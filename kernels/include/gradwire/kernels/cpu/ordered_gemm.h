// The CPU backend's GEMM over FP8 operands: every element of C is computed with the reference
// GEMM's arithmetic (kernels/ref/gemm.h), whatever the shape of the call, the tiling, the split
// over threads or the instruction set:
//
//   acc     = +0, then acc = acc + a[i, k] * b[j, k] for k = 0, 1, ..., K - 1, in fp32
//   c[i, j] = [c[i, j] +] (acc * scale [+ bias[j]])
//
// The operands are decoded FP8 codes (without their scales). The product of two such values is
// exact in fp32, so a fused multiply-add and a multiply followed by an add give the same bits:
// the only rounding is the sum's, once per k, in increasing k. A row of C therefore depends only
// on its own row of A: one request's rows give the same bits alone or stacked with other
// requests' rows (what the dynamic batcher relies on), and the same bits as kernels::Fp8Gemm on
// the same operands (the parity harness checks it).
//
// How it runs (BLIS's split of a GEMM into packing and one register-tile micro-kernel): B is
// packed into panels of kPanelWidth columns, so a micro-kernel step reads one row pair of a panel
// and one value of each of its rows of A, and adds their products into a tile of C held in
// registers. The panels hold bf16: every FP8 value (E4M3 and E5M2, subnormals included) is exact
// in bf16, and a product that streams the weight once (a few rows) reads half the bytes fp32
// panels would take. Each element's sum runs along k in one register lane from k = 0 to K - 1
// and is never split (no split-K), so the tile shape, the edge tiles and the split over threads
// change nothing in it. The panels of a weight are built once per weight version (the CPU
// backend's weight workspace); other operands are packed per call.
//
// The copies differ in how a step adds. The multiply-add copies widen each bf16 value back to
// its fp32 value (a shift or a mask) and add one k at a time. The AVX-512 BF16 copy hands a pair
// of k to vdpbf16ps, which adds both products of each lane, the odd-numbered element's first,
// each add rounded: the pairs are laid out so that this is k = 2t, then 2t + 1, the reference's
// order. The process checks that copy's bits against the baseline's once before it uses it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/block_scaling.h"

namespace gradwire::kernels::cpu {

// Columns of C per panel of B.
inline constexpr int64_t kPanelWidth = 16;

// B packed for the GEMM: ceil(n / kPanelWidth) panels of bf16 values (the upper halves of the
// fp32 values). A panel is ceil(k / 2) row pairs, each one 32-bit word per column (kPanelWidth
// words, 64 bytes, columns in order): depth 2t in the word's upper half, depth 2t + 1 in its
// lower half (zero past an odd k). The columns past n in the last panel are zero. One load gives
// a multiply-add copy both depths of the pair (a mask and a shift), and vdpbf16ps its two
// operands in the order that adds depth 2t first. Not owning.
struct PanelsView {
  int64_t n = 0, k = 0;
  const uint16_t* data = nullptr;
};

// Bytes a packing of B [n, k] takes.
size_t PanelBytes(int64_t n, int64_t k);

// B's value at column j, depth k of packed panels (for tests and checks; the kernel reads them
// in its own order).
float PanelValue(const PanelsView& panels, int64_t j, int64_t k);

// Packs B into `out` (PanelBytes(n, k) bytes), split over the pool. `n_major`: B is stored [n, k]
// (row j contiguous along k); else [k, n]. ld is the stride of the stored rows. Every value must
// be exact in bf16 (decoded FP8 values are); std::invalid_argument names the first one that is
// not, and `out` is then unspecified.
void PackPanels(const float* b, int64_t n, int64_t k, int64_t ld, bool n_major, uint16_t* out);
// The same from FP8 codes, decoded (no scale) as they are packed.
void PackPanelsFromCodes(const uint8_t* codes, Fp8Format format, int64_t n, int64_t k, bool n_major,
                         uint16_t* out);

// The same from block-scaled FP8 codes stored [n, k] (ref/block_scaling.h): code (j, d) times
// grid[(j / block.rows) * grid_ld + d / block.cols], the value DequantizeBlocks gives it, packed
// without a dequantized copy. The block casts' scales keep every such value exact in bf16.
void PackPanelsFromBlockCodes(const uint8_t* codes, Fp8Format format, const float* grid,
                              BlockShape block, int64_t grid_ld, int64_t n, int64_t k,
                              uint16_t* out);

// Owning panels, for a weight workspace: built once per weight version, read by every GEMM of
// that version.
class GemmPanels {
 public:
  GemmPanels(const uint8_t* codes, Fp8Format format, int64_t n, int64_t k, bool n_major);
  ~GemmPanels();
  GemmPanels(const GemmPanels&) = delete;
  GemmPanels& operator=(const GemmPanels&) = delete;
  PanelsView view() const { return {n_, k_, data_}; }

 private:
  int64_t n_, k_;
  uint16_t* data_;
};

struct OrderedGemmArgs {
  int64_t m = 0;             // rows of A and C; n and k are b's
  const float* a = nullptr;  // [m, k], row stride lda (contiguous along k)
  int64_t lda = 0;
  // When set, A is these FP8 codes instead ([m, k], row stride lda), decoded (no scale) as the
  // GEMM packs them, so the decoded operand is never written out whole; `a` is then ignored.
  const uint8_t* a_codes = nullptr;
  Fp8Format a_format = Fp8Format::kE4M3;
  // With a_codes, when set: A's codes are block-scaled (ref/block_scaling.h), and code (i, k)
  // stands for its decoded value times a_block_scale[(i / a_block.rows) * a_block_ld +
  // k / a_block.cols], the value DequantizeBlocks gives it, computed as the GEMM packs it. The
  // scales are the block casts' powers of two, whose exponent range keeps every such value exact
  // in bf16.
  const float* a_block_scale = nullptr;
  BlockShape a_block;
  int64_t a_block_ld = 0;
  PanelsView b;        // B [n, k], packed
  float scale = 1.0f;  // applied once to each sum
  // When set: row i's sums take row_scale[i] instead of `scale` ([m]; rows of A that came from
  // different casts, each with its own scale_inv). Row i's result is then exactly what a GEMM of
  // that row alone with scale = row_scale[i] computes.
  const float* row_scale = nullptr;
  const float* bias = nullptr;  // [n] or nullptr
  bool accumulate = false;      // C += result instead of C = result
  float* c = nullptr;           // [m, n], row stride ldc
  int64_t ldc = 0;
};

void OrderedGemm(const OrderedGemmArgs& args);

// The copies of the micro-kernel, one per instruction set: the same arithmetic, other tiles.
//   kBaseline    the build's default (SSE2 on x86-64): multiply, then add; 2 rows x 16 columns
//   kAvx2        AVX2 + FMA, 8-lane ymm: 6 rows x 16 columns in 12 registers of sums
//   kAvx512      AVX-512F, 16-lane zmm multiply-adds: 24 registers of sums, 6 rows x 64 columns
//   kAvx512Bf16  AVX-512 BF16, vdpbf16ps on pairs of k: 24 registers of sums, 6 rows x 64
//                columns; only where it reproduces the baseline's bits on this CPU (checked
//                once, at the first question about it)
enum class OrderedGemmCopy { kBaseline, kAvx2, kAvx512, kAvx512Bf16 };

// The widest copy this CPU supports, and its name ("avx512bf16", "avx512", "avx2", "baseline")
// for reports.
OrderedGemmCopy OrderedGemmBestCopy();
const char* OrderedGemmCopyName(OrderedGemmCopy copy);
// The copy of that name, or nullopt.
std::optional<OrderedGemmCopy> OrderedGemmCopyByName(const std::string& name);
// Whether this build has the copy and this CPU can run it.
bool OrderedGemmCopySupported(OrderedGemmCopy copy);
// The copy OrderedGemm runs: the best one unless SetOrderedGemmCopy chose another (the server's
// --cpu-isa; the benchmarks). Every copy computes the same bits: the choice changes only speed.
// std::invalid_argument for a copy this build or CPU does not support (naming the best one);
// nullopt goes back to the best.
OrderedGemmCopy OrderedGemmActiveCopy();
void SetOrderedGemmCopy(std::optional<OrderedGemmCopy> copy);
// OrderedGemm on a given supported copy (the tests check that every copy computes the same bits).
// A float A must hold decoded FP8 values (exact in bf16); the AVX-512 BF16 copy checks and runs
// an A that is not on the AVX-512 copy instead.
void OrderedGemmUsing(OrderedGemmCopy copy, const OrderedGemmArgs& args);

}  // namespace gradwire::kernels::cpu
