#include "server/core/tensor_calls.h"

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"

namespace gradwire::core {
namespace {

// `t` as an F32 wire view of a contiguous host copy, which `keep` holds while the view is used.
absl::StatusOr<wire::TensorView> F32View(const std::string& field, const at::Tensor& t,
                                         at::Tensor* keep) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  if (t.scalar_type() != at::kFloat) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be float32"));
  }
  *keep = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  wire::TensorView v;
  v.dtype = wire::DType::kF32;
  v.data = keep->data_ptr();
  v.shape.assign(keep->sizes().begin(), keep->sizes().end());
  return v;
}

at::Tensor Decoded(const wire::EncodedTensor& e) {
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(at::kFloat));
  wire::DecodeElements(e.dtype, e.bytes.data(), t.numel(), e.scale_inv, t.data_ptr<float>());
  return t;
}

ParametersCopy DecodedParameters(const EncodedParameters& p) {
  ParametersCopy out;
  for (const auto& [name, tensor] : p.tensors) out.tensors.emplace_back(name, Decoded(tensor));
  out.weight_version = p.weight_version;
  out.accumulated_backwards = p.accumulated_backwards;
  return out;
}

}  // namespace

absl::StatusOr<ForwardOutput> TensorForward(ModuleHost& host, const std::string& module_id,
                                            const at::Tensor& input, bool training,
                                            const std::string& client) {
  WireForwardRequest req;
  at::Tensor keep;
  GW_ASSIGN_OR_RETURN(req.input, F32View("input", input, &keep));
  req.training = training;
  req.output_dtype = wire::DType::kF32;
  req.client = client;
  GW_ASSIGN_OR_RETURN(WireForwardOutput wire_out, host.Forward(module_id, req));
  ForwardOutput out;
  out.output = Decoded(wire_out.output);
  if (wire_out.has_layernorm_output) out.layernorm_output = Decoded(wire_out.layernorm_output);
  out.context_id = std::move(wire_out.context_id);
  out.weight_version = wire_out.weight_version;
  return out;
}

absl::StatusOr<at::Tensor> TensorBackward(ModuleHost& host, const std::string& context_id,
                                          const BackwardInput& in) {
  WireBackwardRequest req;
  at::Tensor keep, keep_ln;
  GW_ASSIGN_OR_RETURN(req.grad_output, F32View("grad_output", in.grad_output, &keep));
  if (in.grad_layernorm_output.defined()) {
    GW_ASSIGN_OR_RETURN(req.grad_layernorm_output,
                        F32View("grad_layernorm_output", in.grad_layernorm_output, &keep_ln));
  }
  req.retain = in.retain;
  req.skip_grad_input = in.skip_grad_input;
  req.grad_input_dtype = wire::DType::kF32;
  GW_ASSIGN_OR_RETURN(std::optional<wire::EncodedTensor> grad_input,
                      host.Backward(context_id, req));
  return grad_input ? Decoded(*grad_input) : at::Tensor();
}

absl::StatusOr<at::Tensor> TensorBackward(ModuleHost& host, const std::string& context_id,
                                          const at::Tensor& grad_output, bool retain,
                                          bool skip_grad_input) {
  BackwardInput in;
  in.grad_output = grad_output;
  in.retain = retain;
  in.skip_grad_input = skip_grad_input;
  return TensorBackward(host, context_id, in);
}

absl::StatusOr<ParametersCopy> TensorWeights(const ModuleHost& host, const std::string& module_id) {
  GW_ASSIGN_OR_RETURN(EncodedParameters p, host.GetWeights(module_id, wire::DType::kF32));
  return DecodedParameters(p);
}

absl::StatusOr<ParametersCopy> TensorGradients(ModuleHost& host, const std::string& module_id,
                                               bool zero) {
  GW_ASSIGN_OR_RETURN(EncodedParameters p, host.GetGradients(module_id, zero, wire::DType::kF32));
  return DecodedParameters(p);
}

absl::StatusOr<uint64_t> SetTensorWeights(ModuleHost& host, const std::string& module_id,
                                          const NamedTensors& params) {
  NamedViews views;
  std::vector<at::Tensor> keep(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, tensor] = params[i];
    GW_ASSIGN_OR_RETURN(
        wire::TensorView v,
        F32View(absl::StrCat("parameters[", i, "] (", name, ")"), tensor, &keep[i]));
    views.emplace_back(name, std::move(v));
  }
  return host.SetWeights(module_id, views);
}

}  // namespace gradwire::core
