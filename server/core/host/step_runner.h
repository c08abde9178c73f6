// The step runner: forwards and backwards on a module's device. Every call is a batch: a request
// alone is a batch of one, and a batch of several runs as one backend call over the requests'
// stacked rows (docs/batching.md), giving every request bit for bit what it gets alone. One code
// path computes both: where a batch cannot run together (a refusal, a non-finite value, saved
// state over the budget), its requests run again as batches of one, in order, and meet there the
// answer they would have had alone.
//
// It owns the step's part of a module's state: the weight workspace it builds and caches, the
// scaling steps, the finite checks, and the contexts a training forward saves and its backward
// consumes. Transport-free; thread-safe (a module's own lock serialises its steps).
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/wire/codec.h"
#include "server/core/contexts/context_store.h"
#include "server/core/host_types.h"

namespace gradwire::device {
class Backend;
}  // namespace gradwire::device

namespace gradwire::core {

using device::Backend;
class ModuleRegistry;

class StepRunner {
 public:
  StepRunner(const Backend& backend, const ModuleRegistry& modules, ContextStore& contexts)
      : backend_(backend), modules_(modules), contexts_(contexts) {}

  // Forwards of one module, one result per request, each what the request gets alone:
  //  - input [..., in_features] in any wire dtype. An FP8 input reaches the kind as its codes
  //    when the kind UsesFp8Input (a Linear: no re-quantization); bf16 stays bf16 for a kind whose
  //    casts read it.
  //  - Training stores the saved tensors under the request's context id (or a fresh one) and
  //    steps the scaling state; inference creates and changes nothing.
  //  - RESOURCE_EXHAUSTED, before anything changes, when a training forward's saved tensors alone
  //    exceed the context memory budget; OUT_OF_RANGE when a value comes out non-finite.
  // Several requests run together when they are all training or all inference and reach the kind
  // the same way (training with FP8 codes runs alone). Each cast of an activation is one per
  // request (its own amax and scale; under delayed scaling each training request casts with the
  // scale the steps of the requests before it left, and is one step of the history), and the
  // GEMMs apply each request's scale_inv to its rows. Each training request's context holds only
  // its own rows. A malformed request gets its own error and the others go on.
  std::vector<absl::StatusOr<WireForwardOutput>> Forward(
      const std::string& module_id, const std::vector<const WireForwardRequest*>& reqs);

  // Backwards of contexts, one result per request, each what the request gets alone: the
  // parameter gradients are accumulated into the module's buffers, the context is freed before
  // this returns unless `retain`, and grad_input comes back encoded as asked (none with
  // skip_grad_input). A refused backward changes nothing and keeps its context.
  // Consecutive requests run together over their gradients' stacked rows when their contexts are
  // of one module and weight workspace and they agree on skip_grad_input and
  // grad_layernorm_output (checkpointed LayerNorm contexts run alone): each gradient cast is one
  // per request (under delayed scaling one step of the history each, in order), the dgrad GEMMs
  // apply each request's scale_inv to its rows, and each request's weight gradients are its own
  // GEMMs, added to the accumulators request by request. When a value comes out non-finite at
  // request j, j and those after it run alone, in order, after the ones before it were committed.
  // `ran`, when given, gets the requests and rows that ran together (0 when none did).
  std::vector<absl::StatusOr<std::optional<wire::EncodedTensor>>> Backward(
      const std::vector<std::string>& context_ids,
      const std::vector<const WireBackwardRequest*>& reqs, BatchRan* ran = nullptr);

  int64_t workspace_builds() const { return workspace_builds_.load(); }
  int64_t workspace_hits() const { return workspace_hits_.load(); }
  int64_t compute_calls() const { return compute_calls_.load(); }
  int64_t batched_forwards() const { return batched_forwards_.load(); }
  int64_t batched_backwards() const { return batched_backwards_.load(); }
  int64_t results_in_place() const { return results_in_place_.load(); }

 private:
  class ForwardRun;
  class BackwardRun;

  const Backend& backend_;
  const ModuleRegistry& modules_;
  ContextStore& contexts_;
  std::atomic<int64_t> workspace_builds_{0};
  std::atomic<int64_t> workspace_hits_{0};
  std::atomic<int64_t> compute_calls_{0};
  std::atomic<int64_t> batched_forwards_{0};
  std::atomic<int64_t> batched_backwards_{0};
  std::atomic<int64_t> results_in_place_{0};
};

}  // namespace gradwire::core
