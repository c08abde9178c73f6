// FP8 Linear: y = x W^T + b with E4M3 forward casts and E5M2 gradient casts.
//
// The compute functions take the kind's arguments as they are (KindForwardArgs /
// KindBackwardArgs: every input explicit) and hold no module state. The FP8 weight workspace is an
// argument and a result: the caller caches it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/kinds/module_kind.h"

namespace gradwire::core {

// The roles of a kind with one GEMM (Linear, LayerNormLinear), in Roles() order: the cast of the
// GEMM's input, of its weight, and of the gradient coming back.
enum SingleGemmRole : size_t { kInputRole, kWeightRole, kGradOutputRole };
const std::vector<RoleDef>& SingleGemmRoles();

struct LinearSaved final : SavedWithWorkspace {
  Fp8Tensor input;  // columnwise only: X^T [K, M], what wgrad reads
  // workspace: the weight version this forward used (its columnwise copy, for dgrad)
  int64_t bytes() const override { return input.bytes(); }
  void ForEachTensor(const std::function<void(at::Tensor&)>& fn) override {
    fn(input.rowwise);
    fn(input.columnwise);
    fn(input.rowwise_scale_inv);  // block-scaled: the copies' scales
    fn(input.columnwise_scale_inv);
  }
};

// Params: kWeight [N, K], kBias [N] when spec.bias. With args.input_fp8 the input's codes are used
// as they arrived (no re-quantization) and the input quantizer is not.
absl::StatusOr<KindForwardResult> LinearForward(const KindForwardArgs& args);
// dW to Param::kWeight, dbias to kBias; grad_input bounded by DgradBound.
absl::StatusOr<KindBackwardResult> LinearBackward(const KindBackwardArgs& args);
// A batch of Linear contexts of one workspace as one row-grouped saved state (StackSaved).
std::shared_ptr<SavedTensors> LinearStackSaved(const std::vector<const SavedTensors*>& parts);

}  // namespace gradwire::core
