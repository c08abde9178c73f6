#include "server/rpc/request_checks.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/wire/tensor.h"
#include "server/common/status_macros.h"
#include "server/core/kinds/kind_description.h"
#include "server/rpc/boundary.h"

namespace gradwire::rpc {
namespace {

// The chunked calls carry bytes in chunks; a shared-memory reference has no place there.
absl::Status NoSharedMemory(const v1::Tensor& t, absl::string_view field) {
  if (t.has_shared_memory()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field,
        ".shared_memory: shared-memory tensors travel on the unary calls and Train, not on "
        "the chunked calls"));
  }
  return absl::OkStatus();
}

absl::Status NoSharedMemoryResult(absl::string_view field) {
  return absl::InvalidArgumentError(
      absl::StrCat(field,
                   ": shared-memory results are written by the unary calls and Train, not by the "
                   "chunked calls"));
}

int64_t Saturating(int64_t a, int64_t b) {
  return b != 0 && a > std::numeric_limits<int64_t>::max() / b ? std::numeric_limits<int64_t>::max()
                                                               : a * b;
}

}  // namespace

absl::Status RequestChecks::CheckForward(const Caller& caller,
                                         const v1::ForwardRequest& req) const {
  const int64_t limit = limits_.max_tensor_elements;
  const int64_t elements = ShapeElements(req.input());
  GW_RETURN_IF_ERROR(CheckElements("input", elements, limit));
  GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(req.module_id()));
  if (const int dims = req.input().shape_size(); dims > 0) {
    // What the forward would build, from the rows the input declares (a wrong last dimension is
    // the forward's INVALID_ARGUMENT).
    const int64_t rows = elements / std::max<int64_t>(1, req.input().shape(dims - 1));
    for (const auto& [what, width] : core::DescribeKind(spec.kind)->BuiltWidths(spec)) {
      GW_RETURN_IF_ERROR(CheckElements(what, Saturating(rows, width), limit));
    }
  }
  if (!req.context_id().empty()) {
    if (!req.training()) {
      return absl::InvalidArgumentError(
          "context_id names the context of a training forward; an inference forward makes none");
    }
    GW_RETURN_IF_ERROR(CheckId("context_id", req.context_id()));
    // Whether it is taken is PrepareForward's to ask, on the executor: the store's lock is not
    // for a reactor thread (this also checks a chunked call's header).
  }
  const int64_t max_contexts = limits_.max_contexts_per_client;
  if (req.training() && max_contexts > 0) {
    const int64_t live = host_.contexts().live_contexts_of_client(caller.client);
    if (live >= max_contexts) {
      return absl::ResourceExhaustedError(
          absl::StrCat(caller.client, " has ", live, " live training contexts, the limit (",
                       "--max-contexts-per-client ", max_contexts,
                       "); run their backwards or ReleaseContext them first"));
    }
  }
  return absl::OkStatus();
}

absl::Status RequestChecks::CheckHeader(const Caller& caller, const v1::ForwardRequest& req) const {
  GW_RETURN_IF_ERROR(env_.CheckModule(caller, req.module_id()));
  if (!req.has_input()) return absl::InvalidArgumentError("input is required");
  GW_RETURN_IF_ERROR(NoSharedMemory(req.input(), "input"));
  if (req.has_output_shared_memory() || req.has_layernorm_output_shared_memory()) {
    return NoSharedMemoryResult("output_shared_memory");
  }
  GW_RETURN_IF_ERROR(wire::OutputDType(req.output_dtype(), "output_dtype").status());
  GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(req.module_id()));
  const int dims = req.input().shape_size();
  if (dims == 0 || req.input().shape(dims - 1) != spec.in_features) {
    return absl::InvalidArgumentError(absl::StrCat("input.shape must be [..., ", spec.in_features,
                                                   "] (the module's in_features)"));
  }
  return CheckForward(caller, req);
}

absl::Status RequestChecks::CheckHeader(const Caller& caller,
                                        const v1::BackwardRequest& req) const {
  GW_RETURN_IF_ERROR(CheckId("context_id", req.context_id()));
  // The live index only (reactor thread): an unknown, foreign or evicted context is refused here;
  // the unary path's messages say which.
  const std::string module_id =
      host_.contexts().ModuleOf(req.context_id(), caller.isolated ? &caller.tenant : nullptr);
  if (module_id.empty()) {
    return absl::NotFoundError(
        absl::StrCat("context_id ", req.context_id(), " is not a live context"));
  }
  if (!req.has_grad_output()) return absl::InvalidArgumentError("grad_output is required");
  GW_RETURN_IF_ERROR(NoSharedMemory(req.grad_output(), "grad_output"));
  GW_RETURN_IF_ERROR(NoSharedMemory(req.grad_layernorm_output(), "grad_layernorm_output"));
  if (req.has_grad_input_shared_memory()) return NoSharedMemoryResult("grad_input_shared_memory");
  GW_RETURN_IF_ERROR(wire::OutputDType(req.grad_input_dtype(), "grad_input_dtype").status());
  GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(module_id));
  const int dims = req.grad_output().shape_size();
  if (dims == 0 || req.grad_output().shape(dims - 1) != spec.out_features) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grad_output.shape must be [..., ", spec.out_features, "] (the module's out_features)"));
  }
  const int64_t limit = limits_.max_tensor_elements;
  GW_RETURN_IF_ERROR(CheckElements("grad_output", ShapeElements(req.grad_output()), limit));
  if (req.has_grad_layernorm_output()) {
    GW_RETURN_IF_ERROR(
        CheckElements("grad_layernorm_output", ShapeElements(req.grad_layernorm_output()), limit));
  }
  return absl::OkStatus();
}

absl::Status RequestChecks::CheckHeader(const Caller& caller,
                                        const v1::SetWeightsRequest& req) const {
  GW_RETURN_IF_ERROR(env_.CheckModule(caller, req.module_id()));
  GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(req.module_id()));
  const auto shapes = core::ParameterShapes(spec);
  for (int i = 0; i < req.parameters_size(); ++i) {
    const v1::NamedTensor& named = req.parameters(i);
    auto it = shapes.begin();
    while (it != shapes.end() && it->first != named.name()) ++it;
    if (it == shapes.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameters[", i, "] (\"", Escaped(named.name()), "\"): not a parameter of this module"));
    }
    const auto& shape = named.tensor().shape();
    if (!std::equal(shape.begin(), shape.end(), it->second.begin(), it->second.end())) {
      return absl::InvalidArgumentError(absl::StrCat("parameters[", i, "] (", it->first,
                                                     "): the shape must be [",
                                                     absl::StrJoin(it->second, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace gradwire::rpc
