// An FP8-quantized matrix with everything that travels with it: the rowwise codes, the
// transposed (columnwise) codes a GEMM reducing over rows needs, the scale_inv of the cast and the
// amax of the source. Either copy may be absent; nothing is stored twice.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/block_scaling.h"

namespace gradwire::kernels::cpu {
class GemmPanels;
}

namespace gradwire::device {

// A weight's GEMM operand packed from its dequantized values (the CPU backend's, for the
// block-scaled recipes; defined there).
class ValuePanels;

// One cast's scale, scale_inv and amax as the host sees them. The host backends set them as they
// cast. A GPU cast leaves them in device memory and hands over a reader that brings them back the
// first time one of them is asked for (waiting for the cast to run): the host reads them when it
// needs them, not at every cast, and every copy of the tensor shares that one read.
class CastScalars {
 public:
  // Returns {scale, scale_inv, amax}; may throw (a device failure), and is then asked again.
  using Reader = std::function<std::array<float, 3>()>;
  CastScalars() = default;
  CastScalars(float scale, float scale_inv, float amax) : v_{scale, scale_inv, amax} {}
  explicit CastScalars(Reader reader);

  float scale() const { return Values()[0]; }
  float scale_inv() const { return Values()[1]; }
  float amax() const { return Values()[2]; }
  // True while the values are still where the cast left them (nothing has asked for them yet).
  bool pending() const;

 private:
  struct Pending;
  const std::array<float, 3>& Values() const;
  std::array<float, 3> v_{1.0f, 1.0f, 0.0f};
  std::shared_ptr<Pending> pending_;
};

struct Fp8Tensor {
  at::Tensor rowwise;     // uint8 [rows, cols], or undefined
  at::Tensor columnwise;  // uint8 [cols, rows], or undefined
  kernels::Fp8Format format = kernels::Fp8Format::kE4M3;
  // scale: what the cast multiplied by; scale_inv = 1 / scale (real value = decode(code) *
  // scale_inv); amax: of the tensor that was cast. Read through the accessors below.
  CastScalars scalars;
  float scale() const { return scalars.scale(); }
  float scale_inv() const { return scalars.scale_inv(); }
  float amax() const { return scalars.amax(); }
  int64_t rows = 0;
  int64_t cols = 0;
  // The CPU backend's packed GEMM operands of a weight (kernels/cpu/ordered_gemm.h), built once
  // per weight version by Backend::PrepareWeight: W's rows for the forward, W^T's for the input
  // gradient. Empty for activations and on the other backends.
  std::shared_ptr<const kernels::cpu::GemmPanels> fprop_panels;
  std::shared_ptr<const kernels::cpu::GemmPanels> dgrad_panels;
  // The same for a block-scaled weight: panels of its dequantized values (exact in bf16).
  std::shared_ptr<const ValuePanels> fprop_value_panels;
  std::shared_ptr<const ValuePanels> dgrad_value_panels;
  // Block scaling (BLOCK, MXFP8; docs/block-scaling.md). When block_scaled, each copy has a
  // power-of-two scale_inv per block instead of the tensor's one: rowwise_scale_inv fp32
  // [BlockGridRows(rows, rowwise_block), BlockGridCols(cols, rowwise_block)] for the rowwise copy
  // [rows, cols], and columnwise_scale_inv the same for the columnwise copy as it is stored
  // ([cols, rows], blocked by columnwise_block); host tensors (on the host backends). The scalars
  // then hold scale 1, scale_inv 1 and the amax of the source, and max_scale_inv is the largest
  // block scale_inv of either copy (what bounds its decoded values).
  bool block_scaled = false;
  kernels::BlockShape rowwise_block{};
  kernels::BlockShape columnwise_block{};
  at::Tensor rowwise_scale_inv;
  at::Tensor columnwise_scale_inv;
  float max_scale_inv = 1.0f;
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
    if (rowwise_scale_inv.defined()) total += int64_t(rowwise_scale_inv.nbytes());
    if (columnwise_scale_inv.defined()) total += int64_t(columnwise_scale_inv.nbytes());
    for (const Fp8Tensor& g : groups) total += g.bytes();
    return total;
  }
};

}  // namespace gradwire::device
