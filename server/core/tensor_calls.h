// ModuleHost's calls with host tensors in and out (float32 at::Tensor): for the tests, the tools
// and the load tool's in-process baseline (client/load/inprocess.cc), which hold tensors rather
// than wire bytes. The server speaks only the wire forms (module_host.h); each call here is one
// of them, with the tensors viewed as F32 bytes on the way in and decoded on the way out, so it
// takes the same checks, compute and context handling, and F32 carries every value exactly.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "server/core/kinds/device_names.h"
#include "server/core/module_host.h"
#include "server/core/module_state.h"
#include "server/device/backend.h"

namespace gradwire::core {

struct ForwardOutput {
  at::Tensor output;            // float32 [..., out_features]
  at::Tensor layernorm_output;  // float32 [..., in_features] with return_layernorm_output
  std::string context_id;       // empty for inference
  uint64_t weight_version = 0;
};

struct BackwardInput {
  at::Tensor grad_output;            // float32, the shape of that forward's output
  at::Tensor grad_layernorm_output;  // optional, the shape of the forward's input
  bool retain = false;
  bool skip_grad_input = false;
};

struct ParametersCopy {
  NamedTensors tensors;  // float32, in the module's parameter order
  uint64_t weight_version = 0;
  int64_t accumulated_backwards = 0;  // gradients only
};

// ModuleHost::Forward on input float32 [..., in_features] (any device: it is read from the host).
absl::StatusOr<ForwardOutput> TensorForward(ModuleHost& host, const std::string& module_id,
                                            const at::Tensor& input, bool training,
                                            const std::string& client = {});
// ModuleHost::Backward; grad_input on the host, undefined with skip_grad_input.
absl::StatusOr<at::Tensor> TensorBackward(ModuleHost& host, const std::string& context_id,
                                          const BackwardInput& in);
absl::StatusOr<at::Tensor> TensorBackward(ModuleHost& host, const std::string& context_id,
                                          const at::Tensor& grad_output, bool retain,
                                          bool skip_grad_input);
// ModuleHost::GetWeights / GetGradients as F32, decoded.
absl::StatusOr<ParametersCopy> TensorWeights(const ModuleHost& host, const std::string& module_id);
absl::StatusOr<ParametersCopy> TensorGradients(ModuleHost& host, const std::string& module_id,
                                               bool zero);
// ModuleHost::SetWeights from float32 tensors.
absl::StatusOr<uint64_t> SetTensorWeights(ModuleHost& host, const std::string& module_id,
                                          const NamedTensors& params);

}  // namespace gradwire::core
