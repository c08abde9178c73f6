// The CPU backend's block-scaled A operands (docs/block-scaling.md): a block-scaled tensor's
// codes and scale grid as the FP8 GEMM takes them (kernels::cpu::OrderedGemmArgs::a_block_scale),
// so that no dequantized copy of it is written.
#pragma once

#include <cstdint>

#include "gradwire/kernels/cpu/scratch.h"
#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/block_scaling.h"
#include "server/device/fp8_tensor.h"

namespace gradwire::device {

// A block-scaled A operand as its codes and scale grid, which the GEMM decodes and scales as it
// packs them (no dequantized copy is written): one copy of a tensor (rowwise; or columnwise, a
// weight gradient's dY^T), or a batch's groups stacked by rows with their grids, when their
// blocks are one row high (every activation's and gradient's are: 1 x 128, 1 x 32). `codes` is
// null when the operand cannot be given so (groups blocked across rows); the caller then
// dequantizes it.
struct BlockedOperand {
  const uint8_t* codes = nullptr;
  const float* grid = nullptr;
  kernels::BlockShape block;
  int64_t grid_ld = 0;
  kernels::Fp8Format format = kernels::Fp8Format::kE4M3;
  kernels::cpu::Scratch stacked_codes, stacked_grid;  // a batch's groups, stacked
};
BlockedOperand BlockedA(const Fp8Tensor& t, bool rowwise);

}  // namespace gradwire::device
