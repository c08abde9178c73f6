// FP8 Linear: y = x W^T + b with E4M3 forward casts and E5M2 gradient casts.
//
// The compute functions take every input explicitly (LinearFwdArgs / LinearBwdArgs) and hold no
// module state. The FP8 weight workspace is an argument and a result: the caller caches it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/fp8_tensor.h"
#include "server/core/quantizer.h"
#include "server/core/saved_tensors.h"

namespace gradwire::core {

// The FP8 weight of one weight version.
struct LinearWorkspace {
  uint64_t weight_version = 0;
  Fp8Tensor weight;  // rowwise [N, K] always; columnwise [K, N] when built for training
  int64_t bytes() const { return weight.bytes(); }
};
using WorkspacePtr = std::shared_ptr<const LinearWorkspace>;

// True when `ws` can serve a forward of `weight_version` (training needs the columnwise copy).
bool WorkspaceUsable(const WorkspacePtr& ws, uint64_t weight_version, bool training);

struct LinearSaved final : SavedTensors {
  Fp8Tensor input;         // columnwise only: X^T [K, M], what wgrad reads
  WorkspacePtr workspace;  // the weight version this forward used (its columnwise copy for dgrad)
  std::vector<int64_t> input_shape;  // as the client sent it: [..., K]
  int64_t bytes() const override { return input.bytes(); }
};

struct LinearFwdArgs {
  at::Tensor input;   // float32 [M, K], contiguous
  at::Tensor weight;  // float32 [N, K] master weight
  at::Tensor bias;    // float32 [N], or undefined
  uint64_t weight_version = 0;
  WorkspacePtr workspace;            // cached FP8 weight, may be null or stale
  QuantizerConfig input_quantizer;   // E4M3
  QuantizerConfig weight_quantizer;  // E4M3
  bool training = false;
};

struct LinearFwdResult {
  at::Tensor output;                   // float32 [M, N]
  WorkspacePtr workspace;              // args.workspace when usable, else a new one
  bool workspace_built = false;        // true on a cache miss
  std::shared_ptr<LinearSaved> saved;  // training only
};

absl::StatusOr<LinearFwdResult> LinearForward(const LinearFwdArgs& args);

struct LinearBwdArgs {
  at::Tensor grad_output;              // float32 [M, N], contiguous
  const LinearSaved* saved = nullptr;  // from the matching forward
  QuantizerConfig grad_quantizer;      // E5M2
  bool compute_grad_input = true;
  at::Tensor weight_grad;  // float32 [N, K]: dW is accumulated into it
  at::Tensor bias_grad;    // float32 [N]: dbias is accumulated into it; undefined without bias
};

struct LinearBwdResult {
  at::Tensor grad_input;  // float32 [M, K], undefined unless compute_grad_input
};

absl::StatusOr<LinearBwdResult> LinearBackward(const LinearBwdArgs& args);

}  // namespace gradwire::core
