// FP8 GEMM work since the process started, over every backend and thread: what the metrics report
// as achieved FLOP/s. Plain counters, no libtorch.
#pragma once

namespace gradwire::device {

struct GemmCounters {
  double flops = 0;    // 2 * m * n * k per GEMM
  double seconds = 0;  // wall time inside the GEMMs
};
GemmCounters GemmTotals();
// Adds one GEMM's work to the totals.
void CountGemm(double flops, double seconds);

}  // namespace gradwire::device
