#include "gradwire/kernels/ref/gemm.h"

#include <cstddef>
#include <vector>

#include "../cpu/vector_clones.h"

namespace gradwire::kernels {
namespace {

// Decodes an operand (without its scale) into rows x depth floats, contiguous along depth.
// `transposed_storage` says the codes are stored [depth, rows] instead of [rows, depth].
std::vector<float> DecodeReductionMajor(const Fp8Operand& op, int64_t rows, int64_t depth,
                                        bool transposed_storage) {
  const float* table = DecodeTable(op.format);
  std::vector<float> out(static_cast<size_t>(rows * depth));
  if (!transposed_storage) {
    for (int64_t i = 0; i < rows * depth; ++i) out[i] = table[op.data[i]];
  } else {
    for (int64_t d = 0; d < depth; ++d) {
      for (int64_t r = 0; r < rows; ++r) out[r * depth + d] = table[op.data[d * rows + r]];
    }
  }
  return out;
}

// Eight interleaved fp32 partial sums (lane = k mod 8), combined pairwise: a fixed order that the
// compiler can vectorise, for each instruction set the CPU has (vector_clones.h): every clone adds
// the same products in the same order, so the results are bit-identical.
GRADWIRE_VECTOR_CLONES
float Dot(const float* a, const float* b, int64_t k) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < k; ++i, ++l) lanes[l] += a[i] * b[i];
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
         ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

}  // namespace

void Fp8Gemm(const Fp8GemmArgs& args) {
  const int64_t m = args.m, n = args.n, k = args.k;
  // A as [m, k] and B as [n, k]: A is naturally [m, k] unless transposed; B is naturally [k, n]
  // and is [n, k] exactly when transposed.
  std::vector<float> a_decoded, b_decoded;
  const float* a = args.a.decoded;
  if (a == nullptr || args.a.transposed) {
    a_decoded = DecodeReductionMajor(args.a, m, k, args.a.transposed);
    a = a_decoded.data();
  }
  const float* b = args.b.decoded;
  if (b == nullptr || !args.b.transposed) {
    b_decoded = DecodeReductionMajor(args.b, n, k, !args.b.transposed);
    b = b_decoded.data();
  }
  const float scale = args.a.scale_inv * args.b.scale_inv;
  constexpr int64_t kBlock = 64;  // rows of B kept hot in cache across the rows of A
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t j1 = j0 + kBlock < n ? j0 + kBlock : n;
    for (int64_t i = 0; i < m; ++i) {
      float* c_row = args.c + i * n;
      for (int64_t j = j0; j < j1; ++j) {
        float value = Dot(a + i * k, b + j * k, k) * scale;
        if (args.bias) value += args.bias[j];
        c_row[j] = args.accumulate ? c_row[j] + value : value;
      }
    }
  }
}

}  // namespace gradwire::kernels
