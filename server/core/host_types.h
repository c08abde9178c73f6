// What the module host takes and gives, in plain types: module descriptions, the wire forms of a
// step's tensors, encoded parameters, scaling state and counters. No libtorch: the rpc layer sees
// the host through these (module_host.h).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gradwire/wire/codec.h"
#include "server/core/contexts/context_store.h"
#include "server/core/module_spec.h"

namespace gradwire::core {

// The refusal of a call about a module another server sharing the checkpoint directory holds now
// (it took the module over, or was handed it): FAILED_PRECONDITION, "module <id> moved to another
// server: <why>". Behind a proxy a retry reaches the module where it is now. The checkpoints give
// it for a module they no longer hold, the registry for a module dropped as moved.
inline constexpr char kModuleMovedMarker[] = " moved to another server: ";
inline absl::Status ModuleMovedError(absl::string_view module_id, absl::string_view why) {
  return absl::FailedPreconditionError(absl::StrCat("module ", module_id, kModuleMovedMarker, why));
}
inline bool IsModuleMoved(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition &&
         status.message().find(kModuleMovedMarker) != absl::string_view::npos;
}

struct ModuleInfo {
  std::string module_id;
  std::string tenant;  // owner; empty when the server runs without tokens
  ModuleSpec spec;
  uint64_t weight_version = 0;
  int64_t live_contexts = 0;
  int64_t optimizer_steps = 0;
  std::vector<std::string> parameter_names;
  bool row_order_bias_sums = false;  // Backend::SumsColumnsInRowOrder
};

// Forward and Backward take the input as it arrived, as a view of its bytes, and return outputs
// encoded as asked. The backend converts both ways on its own device: nothing is widened to fp32
// on the host first. (Tests and tools holding tensors use tensor_calls.h.)
struct WireForwardRequest {
  wire::TensorView input;  // [..., in_features]
  bool training = false;
  wire::DType output_dtype = wire::DType::kF32;  // of output and layernorm_output
  std::string client;                            // who asked (per-client context counts)
  // Training: the id the context takes (ContextStore::Put); empty: a fresh random one.
  std::string context_id;
};

struct WireForwardOutput {
  wire::EncodedTensor output;            // [..., out_features]
  wire::EncodedTensor layernorm_output;  // [..., in_features]; empty shape unless returned
  bool has_layernorm_output = false;
  std::string context_id;  // empty for inference
  uint64_t weight_version = 0;
  int32_t batch_requests = 0;  // the requests computed together (0: alone)
};

struct WireBackwardRequest {
  wire::TensorView grad_output;            // the shape of that forward's output
  wire::TensorView grad_layernorm_output;  // optional (data null when absent)
  bool retain = false;
  bool skip_grad_input = false;
  wire::DType grad_input_dtype = wire::DType::kF32;
  // BackwardRequest.grad_output_column_sums: empty, or out_features of them (checked against the
  // module by the backward).
  std::vector<float> grad_output_column_sums;
};

using NamedViews = std::vector<std::pair<std::string, wire::TensorView>>;

// Parameters (weights or gradients) encoded for the wire.
struct EncodedParameters {
  std::vector<std::pair<std::string, wire::EncodedTensor>> tensors;  // the module's order
  uint64_t weight_version = 0;
  int64_t accumulated_backwards = 0;  // gradients only
};

// One tensor role's FP8 scaling state, for inspection.
struct RoleScaling {
  std::string role;  // "input", "weight", "grad_output"; "fc1_input", ... for LayerNormMLP
  float scale = 1.0f;
  std::deque<float> history;  // most recent first
};

// What ran as one call of several requests (0 when none did): the batch former's report.
struct BatchRan {
  int64_t requests = 0;
  int64_t rows = 0;
};

struct HostStats {
  int64_t modules = 0;
  int64_t live_contexts = 0;
  int64_t context_bytes = 0;     // device + host
  ContextStats contexts;         // budgets: offloads, restores, evictions
  int64_t workspace_builds = 0;  // FP8 weight casts (cache misses)
  int64_t workspace_hits = 0;
  int64_t compute_calls = 0;      // forwards and backwards started (housekeeping's idle test)
  int64_t batched_forwards = 0;   // forwards computed in a batch with others
  int64_t batched_backwards = 0;  // backwards computed in a batch with others
  // Float32 results (a forward's output, a Linear's grad_input) the GEMM wrote straight into
  // their response's bytes (core/host/wire_destination.h).
  int64_t results_in_place = 0;
  int64_t modules_expired = 0;  // modules released unused for --module-ttl (ExpireIdleModules)
};

}  // namespace gradwire::core
