#include "server/device/cpu_block_operands.h"

#include <ATen/ATen.h>

#include <cstring>

namespace gradwire::device {

BlockedOperand BlockedA(const Fp8Tensor& t, bool rowwise) {
  BlockedOperand out;
  if (!t.grouped()) {
    if (!t.block_scaled) return out;
    const at::Tensor& grid = rowwise ? t.rowwise_scale_inv : t.columnwise_scale_inv;
    out.codes = (rowwise ? t.rowwise : t.columnwise).data_ptr<uint8_t>();
    out.grid = grid.data_ptr<float>();
    out.block = rowwise ? t.rowwise_block : t.columnwise_block;
    out.grid_ld = grid.size(1);
    out.format = t.format;
    return out;
  }
  if (!rowwise) return out;
  const kernels::BlockShape block = t.groups[0].rowwise_block;
  for (const Fp8Tensor& g : t.groups) {
    if (!g.block_scaled || g.rowwise_block.rows != 1 || g.rowwise_block.cols != block.cols ||
        g.format != t.groups[0].format) {
      return out;
    }
  }
  const int64_t grid_cols = kernels::BlockGridCols(t.cols, block);
  out.stacked_codes = kernels::cpu::TakeScratch(size_t(t.rows * t.cols));
  out.stacked_grid = kernels::cpu::TakeScratch(size_t(t.rows * grid_cols) * sizeof(float));
  auto* codes = static_cast<uint8_t*>(out.stacked_codes.data());
  float* grid = out.stacked_grid.floats();
  int64_t row = 0;
  for (const Fp8Tensor& g : t.groups) {
    std::memcpy(codes + row * t.cols, g.rowwise.data_ptr<uint8_t>(), size_t(g.rows * g.cols));
    std::memcpy(grid + row * grid_cols, g.rowwise_scale_inv.data_ptr<float>(),
                size_t(g.rows * grid_cols) * sizeof(float));
    row += g.rows;
  }
  out.codes = codes;
  out.grid = grid;
  out.block = block;
  out.grid_ld = grid_cols;
  out.format = t.groups[0].format;
  return out;
}

}  // namespace gradwire::device
