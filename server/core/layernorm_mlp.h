// FP8 LayerNormMLP: y = FC2(act(FC1(LayerNorm(x)))). Both GEMMs run in FP8 HYBRID: E4M3 casts of
// the LayerNorm output and of the activation output going forward, E5M2 casts of the gradients
// coming back. Gated activations make FC1 produce 2 x ffn features.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/kernels/activation.h"
#include "server/core/fp8_ops.h"
#include "server/core/layernorm_linear.h"
#include "server/core/saved_tensors.h"
#include "server/core/gradients.h"

namespace gradwire::core {

struct LayerNormMlpSaved final : SavedWithWorkspace {
  at::Tensor input;     // float32 [M, K]
  at::Tensor mu, rstd;  // float32 [M]
  // Absent when checkpointed (recomputed in backward):
  Fp8Tensor ln_out;    // columnwise [K, M]: FC1 wgrad
  at::Tensor fc1_out;  // float32 [M, F1]: the activation's backward
  Fp8Tensor act_out;   // columnwise [F, M]: FC2 wgrad
  QuantizerConfig fc1_input_quantizer, fc2_input_quantizer;  // the exact casts, for the recompute
  // workspace: weights[0] = FC1, weights[1] = FC2
  int64_t bytes() const override;
  void ForEachTensor(const std::function<void(at::Tensor&)>& fn) override {
    for (at::Tensor* t : {&input, &mu, &rstd, &ln_out.rowwise, &ln_out.columnwise, &fc1_out,
                          &act_out.rowwise, &act_out.columnwise}) {
      fn(*t);
    }
  }
};

struct LayerNormMlpFwdArgs {
  // The device the compute runs on; null: the reference backend. Tensors live on its device.
  const Backend* backend = nullptr;
  at::Tensor input;  // float32 [M, K]
  LayerNormParams ln;
  at::Tensor fc1_weight;  // float32 [F1, K], F1 = (gated ? 2 : 1) * ffn
  at::Tensor fc1_bias;    // float32 [F1] or undefined
  at::Tensor fc2_weight;  // float32 [N, ffn]
  at::Tensor fc2_bias;    // float32 [N] or undefined
  kernels::Activation activation = kernels::Activation::kGelu;
  uint64_t weight_version = 0;
  WorkspacePtr workspace;
  QuantizerConfig fc1_input_quantizer, fc1_weight_quantizer;  // E4M3
  QuantizerConfig fc2_input_quantizer, fc2_weight_quantizer;  // E4M3
  bool training = false;
  bool return_layernorm_output = false;
  bool checkpoint = false;
};

struct LayerNormMlpFwdResult {
  at::Tensor output;            // float32 [M, N]
  at::Tensor layernorm_output;  // float32 [M, K] when asked for
  WorkspacePtr workspace;
  bool workspace_built = false;
  std::shared_ptr<LayerNormMlpSaved> saved;
  float fc1_input_amax = 0, fc1_weight_amax = 0, fc2_input_amax = 0, fc2_weight_amax = 0;
};

absl::StatusOr<LayerNormMlpFwdResult> LayerNormMlpForward(const LayerNormMlpFwdArgs& args);

struct LayerNormMlpBwdArgs {
  // The device the compute runs on; null: the reference backend. Tensors live on its device.
  const Backend* backend = nullptr;
  at::Tensor grad_output;            // float32 [M, N]
  at::Tensor grad_layernorm_output;  // float32 [M, K] or undefined
  const LayerNormMlpSaved* saved = nullptr;
  LayerNormParams ln;  // eps and zero_centered_gamma; gamma/beta come from the saved workspace
  kernels::Activation activation = kernels::Activation::kGelu;
  QuantizerConfig fc1_grad_quantizer, fc2_grad_quantizer;  // E5M2
  bool compute_grad_input = true;
  bool bias = false;  // FC1 and FC2 have biases (their gradients are wanted)
  // To Param::kLayerNormWeight, kLayerNormBias, kFc1Weight, kFc1Bias, kFc2Weight, kFc2Bias.
  GradientSink* grads = nullptr;
};

struct LayerNormMlpBwdResult {
  at::Tensor grad_input;  // float32 [M, K]
  float fc1_grad_amax = 0, fc2_grad_amax = 0;
};

absl::StatusOr<LayerNormMlpBwdResult> LayerNormMlpBackward(const LayerNormMlpBwdArgs& args);

}  // namespace gradwire::core
