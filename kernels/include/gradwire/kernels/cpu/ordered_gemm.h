// A row-invariant fp32 GEMM for the CPU backend: every element of C is computed with the reference
// GEMM's arithmetic (kernels/ref/gemm.cc), whatever the shape of the call, the tiling or the split
// over threads:
//
//   lanes[l] = sum over k = l, l + 8, l + 16, ... of a[i, k] * b[k, j]   (each product rounded,
//              then added in increasing k: no fused multiply-add)
//   dot      = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
//              ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
//   c[i, j]  = [c[i, j] +] (dot * scale [+ bias[j]])
//
// A row of C therefore depends only on its own row of A, never on which other rows share the
// call: the result of one request's rows is the same bits alone or stacked with other requests'
// rows (the dynamic batcher relies on this), and the same bits as kernels::Fp8Gemm on the same
// operands (the parity harness checks it).
//
// The kernel keeps the eight lane sums of an element in one vector (k runs along it, as the lanes
// do), computes a tile of a few rows of A by a few rows of B at a time, and splits columns or row
// chunks over the pool (parallel.h). The per-element order is the same in every instruction-set
// copy (AVX-512, AVX2, baseline SSE): the bits do not depend on the CPU either.
#pragma once

#include <cstdint>

namespace gradwire::kernels::cpu {

struct OrderedGemmArgs {
  int64_t m = 0, n = 0, k = 0;
  const float* a = nullptr;  // [m, k], row stride lda
  int64_t lda = 0;
  const float* b = nullptr;  // [n, k], row stride ldb (contiguous along k, as the reference reads)
  int64_t ldb = 0;
  float scale = 1.0f;  // applied once to each dot product
  // When set: row i's dot products take row_scale[i] instead of `scale` ([m]; rows of A that
  // came from different casts, each with its own scale_inv). Row i's result is then exactly what
  // a GEMM of that row alone with scale = row_scale[i] computes.
  const float* row_scale = nullptr;
  const float* bias = nullptr;  // [n] or nullptr
  bool accumulate = false;      // C += result instead of C = result
  float* c = nullptr;           // [m, n], row stride ldc
  int64_t ldc = 0;
};

void OrderedGemm(const OrderedGemmArgs& args);

// The copies of the kernel, one per instruction set.
enum class OrderedGemmCopy { kBaseline, kAvx2, kAvx512 };

// The copy OrderedGemm runs on this CPU (the widest it supports), and its name ("avx512", "avx2",
// "baseline") for reports.
OrderedGemmCopy OrderedGemmBestCopy();
const char* OrderedGemmCopyName(OrderedGemmCopy copy);
// Whether this build has the copy and this CPU can run it.
bool OrderedGemmCopySupported(OrderedGemmCopy copy);
// OrderedGemm on a given supported copy (the tests check that every copy computes the same bits).
void OrderedGemmUsing(OrderedGemmCopy copy, const OrderedGemmArgs& args);

}  // namespace gradwire::kernels::cpu
