// FP8 LayerNormLinear: y = LayerNorm(x) W^T + b. LayerNorm runs in fp32; its output is cast to
// E4M3 for the GEMM; gradients are cast to E5M2.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/fp8_ops.h"
#include "server/core/saved_tensors.h"
#include "server/core/gradients.h"

namespace gradwire::core {

struct LayerNormLinearSaved final : SavedWithWorkspace {
  at::Tensor input;     // float32 [M, K]: LayerNorm backward (and the recompute) read it
  at::Tensor mu, rstd;  // float32 [M]
  Fp8Tensor ln_out;     // columnwise [K, M] for wgrad; absent when checkpointed
  QuantizerConfig input_quantizer;  // the exact cast of the forward, for the recompute
  int64_t bytes() const override;
  void ForEachTensor(const std::function<void(at::Tensor&)>& fn) override {
    for (at::Tensor* t : {&input, &mu, &rstd, &ln_out.rowwise, &ln_out.columnwise}) fn(*t);
  }
};

struct LayerNormLinearFwdArgs {
  // The device the compute runs on; null: the reference backend. Tensors live on its device.
  const Backend* backend = nullptr;
  at::Tensor input;  // float32 [M, K]
  LayerNormParams ln;
  at::Tensor weight;  // float32 [N, K]
  at::Tensor bias;    // float32 [N] or undefined
  uint64_t weight_version = 0;
  WorkspacePtr workspace;
  QuantizerConfig input_quantizer;   // E4M3, casts the LayerNorm output
  QuantizerConfig weight_quantizer;  // E4M3
  bool training = false;
  bool return_layernorm_output = false;
  bool checkpoint = false;  // save only the input (+ mu, rstd); backward recomputes the rest
};

struct LayerNormLinearFwdResult {
  at::Tensor output;            // float32 [M, N]
  at::Tensor layernorm_output;  // float32 [M, K] when asked for
  WorkspacePtr workspace;
  bool workspace_built = false;
  std::shared_ptr<LayerNormLinearSaved> saved;
  float input_amax = 0.0f;
  float weight_amax = 0.0f;
};

absl::StatusOr<LayerNormLinearFwdResult> LayerNormLinearForward(const LayerNormLinearFwdArgs& args);

struct LayerNormLinearBwdArgs {
  // The device the compute runs on; null: the reference backend. Tensors live on its device.
  const Backend* backend = nullptr;
  at::Tensor grad_output;            // float32 [M, N]
  at::Tensor grad_layernorm_output;  // float32 [M, K] or undefined
  const LayerNormLinearSaved* saved = nullptr;
  LayerNormParams ln;              // gamma for the backward (eps unused)
  QuantizerConfig grad_quantizer;  // E5M2
  bool compute_grad_input = true;
  bool bias = false;  // the layer has a bias (its gradient is wanted)
  // dW to Param::kWeight, dbias to kBias, dgamma to kLayerNormWeight, dbeta to kLayerNormBias.
  GradientSink* grads = nullptr;
};

struct LayerNormLinearBwdResult {
  at::Tensor grad_input;  // float32 [M, K]
  float grad_output_amax = 0.0f;
};

absl::StatusOr<LayerNormLinearBwdResult> LayerNormLinearBackward(
    const LayerNormLinearBwdArgs& args);

// The reference LayerNorm on host tensors (CpuBackend's): forward into fresh tensors, and the
// backward that returns dx and accumulates gamma_grad / beta_grad.
LayerNormOut RunLayerNorm(const at::Tensor& x, const LayerNormParams& ln);
at::Tensor RunLayerNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mu,
                                const at::Tensor& rstd, const LayerNormParams& ln,
                                at::Tensor& gamma_grad, at::Tensor& beta_grad);

}  // namespace gradwire::core
