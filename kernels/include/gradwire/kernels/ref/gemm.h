// FP8 GEMM of the reference backend.
//
//   C[m, n] (+)= scale_inv_a * scale_inv_b * sum_k op(A)[m, k] * op(B)[k, n]  (+ bias[n])
//
// Products of FP8 values are exact in fp32. Each element's sum starts at +0 and adds them one at a
// time in increasing k, rounding to fp32 after each add (one rounding per k, the order a
// register-tile micro-kernel keeps: kernels/cpu/ordered_gemm.h). The scale is applied once per
// output, then the bias is added, as the tensor-core GEMM does:
//   c[i, j] = [c[i, j] +] (sum * scale_inv_a * scale_inv_b [+ bias[j]])
// op(X) is X or X^T:
//   A is stored [m, k] (transposed = false) or [k, m] (transposed = true);
//   B is stored [k, n] (transposed = false) or [n, k] (transposed = true).
// The three products of a Linear layer in the layout FP8 tensor cores require (both operands
// contiguous along k):
//   forward  Y[M,N]  = X[M,K]   . W[N,K]^T     a = X rowwise,    b = W rowwise (transposed)
//   dgrad    dX[M,K] = dY[M,N]  . W^T[K,N]^T   a = dY rowwise,   b = W columnwise (transposed)
//   wgrad    dW[N,K] = dY^T[N,M] . X^T[K,M]^T  a = dY columnwise, b = X columnwise (transposed)
#pragma once

#include <cstdint>

#include "gradwire/kernels/fp8.h"

namespace gradwire::kernels {

struct Fp8Operand {
  const uint8_t* data = nullptr;  // host, FP8 codes
  Fp8Format format = Fp8Format::kE4M3;
  float scale_inv = 1.0f;  // real value = decode(code) * scale_inv
  bool transposed = false;
};

struct Fp8GemmArgs {
  Fp8Operand a;
  Fp8Operand b;
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  float* c = nullptr;           // host, [m, n] row-major fp32
  const float* bias = nullptr;  // host, [n], or nullptr
  bool accumulate = false;      // C += result instead of C = result
};

void Fp8Gemm(const Fp8GemmArgs& args);

// The same arithmetic on operands that are already values, with scale 1 (the block-scaled
// recipes' GEMM, docs/block-scaling.md: each operand dequantized exactly, block by block):
//   c[i, j] = [c[i, j] +] (sum_k a[i, k] * b[j, k] [+ bias[j]])
// a [m, k] and b [n, k] row-major (both contiguous along k), c [m, n]; host memory. Equal to the
// CPU backend's GEMM on the same values (kernels/cpu/ordered_gemm.h) when every product is exact
// in fp32 and no nonzero product or partial sum is below 2^-126 in magnitude.
void FloatGemm(const float* a, const float* b, int64_t m, int64_t n, int64_t k, float* c,
               const float* bias, bool accumulate);

}  // namespace gradwire::kernels
