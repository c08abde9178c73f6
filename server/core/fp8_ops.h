// The FP8 building blocks every module composes: the weight workspace and the three GEMMs of a
// linear layer, each in the layout FP8 tensor cores need (both operands contiguous along the
// reduction).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/fp8_tensor.h"
#include "server/core/quantizer.h"

namespace gradwire::core {

// What a backward needs from the weights of one weight version: the FP8 weights (one per linear
// layer, in order) and fp32 copies of the small parameters it reads (LayerNorm gamma and beta,
// FC1's bias), so a context keeps computing with its own version after an optimizer step.
struct WeightWorkspace {
  uint64_t weight_version = 0;
  std::vector<Fp8Tensor> weights;  // rowwise always; columnwise too when built for training
  std::vector<at::Tensor> aux;     // fp32 copies, in the order the module passed them
  bool has_columnwise() const;
  int64_t bytes() const;
};
using WorkspacePtr = std::shared_ptr<const WeightWorkspace>;

// True when `ws` can serve a forward of `weight_version` (training needs the columnwise copies).
bool WorkspaceUsable(const WorkspacePtr& ws, uint64_t weight_version, bool training);

struct WorkspaceResult {
  WorkspacePtr workspace;
  bool built = false;  // a cache miss: the weights were cast now
};

// Returns `cached` when usable, else casts `weights` (float32 [N, K] each) with `quantizers` and
// copies `aux` (undefined entries stay undefined).
absl::StatusOr<WorkspaceResult> GetOrBuildWorkspace(const WorkspacePtr& cached,
                                                    uint64_t weight_version, bool training,
                                                    const std::vector<at::Tensor>& weights,
                                                    const std::vector<QuantizerConfig>& quantizers,
                                                    const std::vector<at::Tensor>& aux = {});

// y[M, N] = x[M, K] . w[N, K]^T (+ bias[N]); x and w rowwise. fp32 out.
at::Tensor Fp8Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias);

// dx[M, K] = dy[M, N] . w[N, K]; dy rowwise, w columnwise.
at::Tensor Fp8Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w);

// acc[N, K] += dy[M, N]^T . x[M, K]; dy and x columnwise.
void Fp8WgradAccumulate(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc);

// acc[N] += column sums of g[M, N] (fp32, unquantized).
void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc);

// FP8 GEMM work since the process started (all threads): what metrics report as achieved FLOP/s.
struct GemmCounters {
  double flops = 0;    // 2 * m * n * k per GEMM
  double seconds = 0;  // wall time inside the GEMMs
};
GemmCounters GemmTotals();

// Flattens [..., last] to a contiguous float32 [rows, last].
at::Tensor As2D(const at::Tensor& t);

}  // namespace gradwire::core
