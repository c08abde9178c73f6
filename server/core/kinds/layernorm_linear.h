// FP8 LayerNormLinear: y = LayerNorm(x) W^T + b. LayerNorm runs in fp32; its output is cast to
// E4M3 for the GEMM; gradients are cast to E5M2.
//
// The LayerNorm head of the forward and tail of the backward are shared with LayerNormMLP
// (layernorm_mlp.cc), which normalises its input the same way.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/kinds/module_kind.h"

namespace gradwire::core {

// What the LayerNorm kinds save of their LayerNorm: the input and the statistics its backward
// (and a recompute) read.
struct LayerNormSaved : SavedWithWorkspace {
  // [M, K], float32 or bfloat16 as the request came (half the bytes): owned (the request's bytes
  // do not outlive the call); read through Backend::Widen.
  at::Tensor input;
  at::Tensor mu, rstd;  // float32 [M]
  int64_t layernorm_bytes() const {
    return (input.defined() ? int64_t(input.nbytes()) : 0) + (mu.numel() + rstd.numel()) * 4;
  }
};

struct LayerNormLinearSaved final : LayerNormSaved {
  Fp8Tensor ln_out;                 // columnwise [K, M] for wgrad; absent when checkpointed
  QuantizerConfig input_quantizer;  // the exact cast of the forward, for the recompute
  int64_t bytes() const override { return layernorm_bytes() + ln_out.bytes(); }
  void ForEachTensor(const std::function<void(at::Tensor&)>& fn) override {
    for (at::Tensor* t : {&input, &mu, &rstd, &ln_out.rowwise, &ln_out.columnwise,
                          &ln_out.rowwise_scale_inv, &ln_out.columnwise_scale_inv}) {
      fn(*t);
    }
  }
};

// Params: kLayerNormWeight and kLayerNormBias [K], kWeight [N, K], kBias [N] when spec.bias;
// spec.return_layernorm_output and spec.checkpoint (save only the input, mu and rstd; backward
// recomputes the rest) are honoured.
absl::StatusOr<KindForwardResult> LayerNormLinearForward(const KindForwardArgs& args);
// dW to Param::kWeight, dbias to kBias, dgamma to kLayerNormWeight, dbeta to kLayerNormBias.
absl::StatusOr<KindBackwardResult> LayerNormLinearBackward(const KindBackwardArgs& args);

// The LayerNorm kinds' shared parts.
// LayerNorm gamma (ones, zeros when zero-centered) and beta (zeros), [in_features] each.
std::vector<ParamDef> LayerNormParamDefs(const ModuleSpec& spec);
// The LayerNorm of `params` (device copies) under `spec`'s eps and gamma convention.
LayerNormParams LayerNormOf(const ParamTable& params, const ModuleSpec& spec);
// The forward's head: LayerNorm of args.input and the cast of its output under `config` (a
// batch's row-grouped), one fused call where the backend has it (LayerNormCastRows); hands the
// LayerNorm output to `result` when the spec returns it, and for training keeps what the backward
// reads in `saved`. `ln` receives mu and rstd (a batch's contexts copy their rows of them).
absl::StatusOr<Fp8Tensor> LayerNormHead(const Backend& b, const KindForwardArgs& args,
                                        const QuantizerConfig& config, CastUsage usage,
                                        KindForwardResult* result, LayerNormSaved* saved,
                                        LayerNormOut* ln);
// The LayerNorm of the forward's weight version: gamma and beta pinned in the saved workspace
// (its aux[0] and aux[1]).
LayerNormParams SavedLayerNorm(const ModuleSpec& spec, const LayerNormSaved& saved);
// The backward's tail: `d_ln` (the gradient at the LayerNorm output, from the GEMM after it) plus
// grad_layernorm_output when given, through the LayerNorm backward; dgamma and dbeta go to the
// sink, dx into `result` when args ask for grad_input.
void LayerNormTail(const Backend& b, const KindBackwardArgs& args, const LayerNormSaved& saved,
                   const LayerNormParams& ln, at::Tensor d_ln, KindBackwardResult* result);

// A batch of backwards (StackSaved): the LayerNorm state of several contexts of one workspace,
// stacked by rows in order, into `out` (input, mu, rstd, workspace); false when their
// workspaces differ.
bool StackLayerNorm(const std::vector<const LayerNormSaved*>& parts, LayerNormSaved* out);
std::shared_ptr<SavedTensors> LayerNormLinearStackSaved(
    const std::vector<const SavedTensors*>& parts);

}  // namespace gradwire::core
