// FP8 Linear: y = x W^T + b with E4M3 forward casts and E5M2 gradient casts.
//
// The compute functions take every input explicitly (LinearFwdArgs / LinearBwdArgs) and hold no
// module state. The FP8 weight workspace is an argument and a result: the caller caches it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/fp8_ops.h"
#include "server/core/gradients.h"
#include "server/core/saved_tensors.h"

namespace gradwire::core {

struct LinearSaved final : SavedWithWorkspace {
  Fp8Tensor input;  // columnwise only: X^T [K, M], what wgrad reads
  // workspace: the weight version this forward used (its columnwise copy, for dgrad)
  int64_t bytes() const override { return input.bytes(); }
  void ForEachTensor(const std::function<void(at::Tensor&)>& fn) override {
    fn(input.rowwise);
    fn(input.columnwise);
  }
};

struct LinearFwdArgs {
  // The device the compute runs on; null: the reference backend. Tensors live on its device.
  const Backend* backend = nullptr;
  at::Tensor input;   // float32 [M, K], contiguous
  at::Tensor weight;  // float32 [N, K] master weight
  at::Tensor bias;    // float32 [N], or undefined
  uint64_t weight_version = 0;
  WorkspacePtr workspace;            // cached FP8 weight, may be null or stale
  QuantizerConfig input_quantizer;   // E4M3
  QuantizerConfig weight_quantizer;  // E4M3
  bool training = false;
  // The input as it arrived in FP8 (codes + scale_inv), to be used without re-quantizing; when
  // set, `input` is its dequantized copy and input_quantizer is not used.
  const Fp8Tensor* input_fp8 = nullptr;
};

struct LinearFwdResult {
  at::Tensor output;                   // float32 [M, N]
  WorkspacePtr workspace;              // args.workspace when usable, else a new one
  bool workspace_built = false;        // true on a cache miss
  std::shared_ptr<LinearSaved> saved;  // training only
  float input_amax = 0.0f;
  float weight_amax = 0.0f;
};

absl::StatusOr<LinearFwdResult> LinearForward(const LinearFwdArgs& args);

struct LinearBwdArgs {
  // The device the compute runs on; null: the reference backend. Tensors live on its device.
  const Backend* backend = nullptr;
  at::Tensor grad_output;              // float32 [M, N], contiguous
  const LinearSaved* saved = nullptr;  // from the matching forward
  QuantizerConfig grad_quantizer;      // E5M2
  bool compute_grad_input = true;
  bool bias = false;  // the layer has a bias (its gradient is wanted)
  // dW goes to Param::kWeight, dbias to Param::kBias.
  GradientSink* grads = nullptr;
};

struct LinearBwdResult {
  at::Tensor grad_input;  // float32 [M, K], undefined unless compute_grad_input
  double grad_input_bound = INFINITY;  // >= max |grad_input| (DgradBound)
  float grad_output_amax = 0.0f;
};

absl::StatusOr<LinearBwdResult> LinearBackward(const LinearBwdArgs& args);

}  // namespace gradwire::core
