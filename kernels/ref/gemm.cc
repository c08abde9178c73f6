#include "gradwire/kernels/ref/gemm.h"

#include <algorithm>
#include <cstddef>
#include <vector>

#include "../cpu/vector_clones.h"

namespace gradwire::kernels {
namespace {

// Decodes an operand (without its scale) into `outer` x `inner` floats, contiguous along inner.
// `swap`: the codes are stored [inner, outer].
std::vector<float> DecodeAs(const Fp8Operand& op, int64_t outer, int64_t inner, bool swap) {
  const float* table = DecodeTable(op.format);
  std::vector<float> out(static_cast<size_t>(outer * inner));
  if (!swap) {
    for (int64_t i = 0; i < outer * inner; ++i) out[i] = table[op.data[i]];
  } else {
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t i = 0; i < inner; ++i) out[o * inner + i] = table[op.data[i * outer + o]];
    }
  }
  return out;
}

// sums[j] += a * b[j] for j < n: one product (exact for decoded FP8 values) and one rounded add
// per element. Every clone (vector_clones.h) adds the same products in the same order, so the
// results are bit-identical; the compiler vectorises along j, never along k.
GRADWIRE_VECTOR_CLONES
void AddScaledRow(float a, const float* b, int64_t n, float* sums) {
  for (int64_t j = 0; j < n; ++j) sums[j] += a * b[j];
}

// C (+)= (A . B) * scale (+ bias): a [m, k], b [k, n] (each depth's row of B contiguous along
// n), so that a row of C is a sum over k of A's value times B's row.
void GemmValues(const float* a, const float* b, int64_t m, int64_t n, int64_t k, float scale,
                float* c, const float* bias, bool accumulate) {
  constexpr int64_t kBlock = 256;  // columns of C summed at a time, kept in cache across k
  std::vector<float> sums(static_cast<size_t>(std::min(n, kBlock)));
  for (int64_t i = 0; i < m; ++i) {
    float* c_row = c + i * n;
    for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
      const int64_t width = std::min(kBlock, n - j0);
      std::fill(sums.begin(), sums.begin() + width, 0.0f);
      for (int64_t d = 0; d < k; ++d)
        AddScaledRow(a[i * k + d], b + d * n + j0, width, sums.data());
      for (int64_t j = 0; j < width; ++j) {
        float value = sums[j] * scale;
        if (bias) value += bias[j0 + j];
        c_row[j0 + j] = accumulate ? c_row[j0 + j] + value : value;
      }
    }
  }
}

}  // namespace

void Fp8Gemm(const Fp8GemmArgs& args) {
  const std::vector<float> a = DecodeAs(args.a, args.m, args.k, args.a.transposed);
  const std::vector<float> b = DecodeAs(args.b, args.k, args.n, args.b.transposed);
  GemmValues(a.data(), b.data(), args.m, args.n, args.k, args.a.scale_inv * args.b.scale_inv,
             args.c, args.bias, args.accumulate);
}

void FloatGemm(const float* a, const float* b, int64_t m, int64_t n, int64_t k, float* c,
               const float* bias, bool accumulate) {
  std::vector<float> b_kn(static_cast<size_t>(n * k));  // B as [k, n]
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < k; ++d) b_kn[size_t(d * n + j)] = b[j * k + d];
  }
  GemmValues(a, b_kn.data(), m, n, k, 1.0f, c, bias, accumulate);
}

}  // namespace gradwire::kernels
