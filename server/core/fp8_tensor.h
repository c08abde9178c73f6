// An FP8-quantized matrix with everything that travels with it: the rowwise codes, the
// transposed (columnwise) codes a GEMM reducing over rows needs, the scale_inv of the cast and the
// amax of the source. Either copy may be absent; nothing is stored twice.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "gradwire/kernels/fp8.h"

namespace gradwire::core {

struct Fp8Tensor {
  at::Tensor rowwise;     // uint8 [rows, cols], or undefined
  at::Tensor columnwise;  // uint8 [cols, rows], or undefined
  kernels::Fp8Format format = kernels::Fp8Format::kE4M3;
  float scale = 1.0f;      // the scale the cast multiplied by
  float scale_inv = 1.0f;  // 1 / scale: real value = decode(code) * scale_inv
  float amax = 0.0f;       // amax of the tensor that was cast
  int64_t rows = 0;
  int64_t cols = 0;
  // Optional decoded copies (codes as floats, without the scale, in storage order) that the
  // reference GEMM reads instead of decoding per call: the weight workspace fills them once per
  // weight version. Empty for activations.
  std::shared_ptr<const std::vector<float>> rowwise_decoded;
  std::shared_ptr<const std::vector<float>> columnwise_decoded;
  // scale_inv in device memory (fp32 [1], 16-byte aligned) for backends whose GEMM reads it from
  // there (CUDA); undefined on the CPU backend. Always equal to `scale_inv`.
  at::Tensor scale_inv_device;
  // A row-grouped tensor (the rows of a batch of requests, each cast on its own as if alone):
  // these parts, stacked by rows, each with its own scale, scale_inv and amax and its own copies.
  // Then rowwise and columnwise stay undefined here, rows is the parts' total, amax their largest
  // (NaN when one is NaN) and scale / scale_inv mean nothing. Empty for an ordinary tensor.
  std::vector<Fp8Tensor> groups;

  bool has_rowwise() const { return rowwise.defined(); }
  bool has_columnwise() const { return columnwise.defined(); }
  bool grouped() const { return !groups.empty(); }
  // Bytes of FP8 codes held (both copies).
  int64_t bytes() const {
    int64_t total = (has_rowwise() ? rows * cols : 0) + (has_columnwise() ? rows * cols : 0);
    for (const Fp8Tensor& g : groups) total += g.bytes();
    return total;
  }
};

}  // namespace gradwire::core
