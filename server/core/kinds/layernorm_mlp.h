// FP8 LayerNormMLP: y = FC2(act(FC1(LayerNorm(x)))). Both GEMMs run in FP8 HYBRID: E4M3 casts of
// the LayerNorm output and of the activation output going forward, E5M2 casts of the gradients
// coming back. Gated activations make FC1 produce 2 x ffn features. The LayerNorm is
// LayerNormLinear's (layernorm_linear.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>

#include "absl/status/statusor.h"
#include "server/core/kinds/layernorm_linear.h"
#include "server/core/kinds/module_kind.h"

namespace gradwire::core {

// LayerNormMLP's roles, in Roles() order: the casts of FC1's and FC2's inputs and weights, and of
// the two gradients coming back.
enum MlpRole : size_t {
  kFc1InputRole,
  kFc1WeightRole,
  kFc2InputRole,
  kFc2WeightRole,
  kFc1GradRole,
  kFc2GradRole
};

struct LayerNormMlpSaved final : LayerNormSaved {
  // Absent when checkpointed (recomputed in backward):
  Fp8Tensor ln_out;    // columnwise [K, M]: FC1 wgrad
  at::Tensor fc1_out;  // float32 [M, F1]: the activation's backward
  Fp8Tensor act_out;   // columnwise [F, M]: FC2 wgrad
  QuantizerConfig fc1_input_quantizer, fc2_input_quantizer;  // the exact casts, for the recompute
  // workspace: weights[0] = FC1, weights[1] = FC2; aux = gamma, beta, FC1's bias
  int64_t bytes() const override;
  void ForEachTensor(const std::function<void(at::Tensor&)>& fn) override {
    for (at::Tensor* t :
         {&input, &mu, &rstd, &ln_out.rowwise, &ln_out.columnwise, &fc1_out, &act_out.rowwise,
          &act_out.columnwise, &ln_out.rowwise_scale_inv, &ln_out.columnwise_scale_inv,
          &act_out.rowwise_scale_inv, &act_out.columnwise_scale_inv}) {
      fn(*t);
    }
  }
};

// Params: kLayerNormWeight and kLayerNormBias [K], kFc1Weight [F1, K] (F1 = (gated ? 2 : 1) *
// ffn), kFc2Weight [N, ffn], and kFc1Bias [F1] and kFc2Bias [N] when spec.bias; the activation,
// return_layernorm_output and checkpoint come from the spec.
absl::StatusOr<KindForwardResult> LayerNormMlpForward(const KindForwardArgs& args);
// To Param::kLayerNormWeight, kLayerNormBias, kFc1Weight, kFc1Bias, kFc2Weight, kFc2Bias.
absl::StatusOr<KindBackwardResult> LayerNormMlpBackward(const KindBackwardArgs& args);
// A batch of non-checkpointed LayerNormMLP contexts of one workspace as one row-grouped saved
// state (StackSaved); null otherwise.
std::shared_ptr<SavedTensors> LayerNormMlpStackSaved(const std::vector<const SavedTensors*>& parts);

}  // namespace gradwire::core
