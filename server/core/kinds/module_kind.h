// A module kind is one object: the parameters it has, the FP8 tensor roles it scales, the spec
// fields it reads and what it checks in them, its forward and its backward. The three kinds live
// next to their compute functions (linear.cc, layernorm_linear.cc, layernorm_mlp.cc); the registry
// below holds them. ModuleHost keeps ownership, locking, the weight workspace, scaling state and
// contexts, and calls the kind: it never switches on the kind itself.
//
// Parameters are reached by typed handles (Param): a kind's compute reads and writes them through
// a ParamTable, so a misspelt parameter is a compile error, not an undefined tensor. Names exist
// only at the boundary: weights in and out, gradients out, checkpoints.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/core/kinds/device_names.h"
#include "server/core/kinds/fp8_ops.h"
#include "server/core/kinds/gradients.h"
#include "server/core/kinds/kind_description.h"
#include "server/core/kinds/params.h"
#include "server/core/kinds/saved_tensors.h"
#include "server/core/module_spec.h"
#include "server/device/backend.h"

namespace gradwire::core {

// One parameter of a module: its handle, shape and initial values.
struct ParamDef {
  enum class Init {
    kUniform,  // uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)) from the spec's seed
    kOnes,
    kZeros,
  };
  Param param;
  std::vector<int64_t> shape;
  Init init = Init::kUniform;
  int64_t fan_in = 0;  // kUniform
};

// One FP8 tensor role: the scaling state a module keeps for it (amax history, scale).
struct RoleDef {
  const char* name;  // "input", "weight", "grad_output"; "fc1_input", ... for LayerNormMLP
  kernels::Fp8Format format;
  // A weight: cast once per weight version, with a scale from its own amax under either recipe
  // (a delayed scale would be whatever the history held when the version was first used).
  bool weight = false;
};

// The role of one amax a forward or backward measured: an index into ModuleKindOps::Roles().
using RoleAmax = std::pair<size_t, float>;
// The same, as the kinds hand it over: the cast whose amax() it is, read when first asked for (on
// a GPU, after the call's result has crossed back: no wait of its own).
using RoleCast = std::pair<size_t, CastScalars>;
// The amaxes of `casts`, read.
std::vector<RoleAmax> ReadAmaxes(const std::vector<RoleCast>& casts);

// Everything a kind's forward reads; tensors live on `backend`'s device. The compute functions
// (LinearForward, LayerNormLinearForward, LayerNormMlpForward) take it as it is.
struct KindForwardArgs {
  const Backend* backend = nullptr;  // null: the reference backend
  const ModuleSpec* spec = nullptr;
  at::Tensor input;                      // float32 [M, in_features] (or bf16: UsesBf16Input)
  const Fp8Tensor* input_fp8 = nullptr;  // the input's FP8 codes as they arrived, when the kind
                                         // UsesFp8Input (then `input` is their decoded copy)
  ParamTable params;                     // the module's parameters (device copies)
  // One per role, in Roles() order; a weight role's scale is 0 (its own amax).
  std::vector<QuantizerConfig> quantizers;
  uint64_t weight_version = 0;
  WorkspacePtr workspace;  // the cached FP8 weights, may be null or stale
  bool training = false;
  // The output leaves as bf16: the last GEMM's output comes back so (FpropRows with bf16), bit
  // for bit the bf16 rounding of the fp32 output.
  bool bf16_output = false;
  // Where defined: float32 [M, out_features] on the backend's device, the response's bytes; the
  // kind's last GEMM may write its output there (FpropRows with `into`) and return it as its
  // output, so that nothing is copied to encode it. A kind may ignore it.
  at::Tensor output_into;
};

struct KindForwardResult {
  at::Tensor output;            // float32 [M, out_features] (bfloat16 with args.bf16_output)
  at::Tensor layernorm_output;  // float32 [M, in_features] when the spec asks for it
  WorkspacePtr workspace;       // args.workspace when usable, else a new one
  bool workspace_built = false;
  std::shared_ptr<SavedTensors> saved;  // training only
  // Training over a batch (the input quantizer has row_groups): one saved state per request, in
  // order, each holding only that request's rows; `saved` is then null.
  std::vector<std::shared_ptr<SavedTensors>> saved_groups;
  std::vector<RoleCast> amaxes;  // what this forward measured, per role
};

// Everything a kind's backward reads and writes; tensors live on `backend`'s device. The
// parameters it reads are those of the forward's weight version, pinned in the saved workspace.
struct KindBackwardArgs {
  const Backend* backend = nullptr;  // null: the reference backend
  const ModuleSpec* spec = nullptr;
  at::Tensor grad_output;            // float32 [M, out_features] (bfloat16: UsesBf16GradOutput)
  at::Tensor grad_layernorm_output;  // float32 [M, in_features] or undefined
  // grad_output's FP8 codes as they arrived, when they are what the kind's grad_output cast
  // (Fp8GradOutputRole) would make (device::CodesServeGradient); `grad_output` is then their
  // decoded copy. A batch's: one group per request.
  const Fp8Tensor* grad_output_fp8 = nullptr;
  // The bias gradient as the requests gave it (BackwardRequest.grad_output_column_sums): float32
  // [requests, out_features], a row per request. Undefined: grad_output's columns are summed.
  at::Tensor grad_output_sums;
  const SavedTensors* saved = nullptr;      // from the matching forward of this kind
  GradientSink* grads = nullptr;            // every parameter gradient goes here
  std::vector<QuantizerConfig> quantizers;  // one per role
  bool compute_grad_input = true;
  // Where defined: float32 [M, in_features], the response's bytes, which a kind whose
  // grad_input is a GEMM's output may have it write (DgradRows with `into`), as output_into.
  at::Tensor grad_input_into;
  // A batch of backwards (docs/batching.md): the requests' rows, in order, which `saved` (from
  // StackSaved), grad_output and the gradient roles' quantizers share; null: one backward.
  std::shared_ptr<const std::vector<int64_t>> row_groups;
};

struct KindBackwardResult {
  at::Tensor grad_input;  // float32 [M, in_features], undefined unless compute_grad_input
  // >= max |grad_input| when the kind can bound it (DgradBound), worked out when called: it reads
  // the casts' scales, so the caller asks only after grad_input has been handed on (on a GPU the
  // scales have crossed back by then). Null: no bound, the caller must measure.
  std::function<double()> grad_input_bound;
  std::vector<RoleCast> amaxes;
};

// The compute side of a kind; its names, spec fields and checks are its KindDescription's.
class ModuleKindOps : public KindDescription {
 public:
  // The parameters a spec makes, in the module's order (dimensions taken as they are).
  virtual std::vector<ParamDef> Params(const ModuleSpec& spec) const = 0;
  virtual const std::vector<RoleDef>& Roles() const = 0;
  // True when the forward uses FP8 input codes as they arrived (no re-quantization); otherwise
  // it reads the decoded input.
  virtual bool UsesFp8Input() const { return false; }
  // True when the forward's input may be bfloat16 as it arrived (Backend::FromWireBf16): a cast
  // reads bf16, and what needs fp32 widens it there (Backend::Widen: LayerNorm, whose saved
  // input then keeps half the bytes). Otherwise a bf16 request is widened to fp32 on arrival.
  virtual bool UsesBf16Input() const { return false; }
  // True when the backward may take grad_output as bfloat16 as it arrived: it only casts it and
  // sums its columns (GradientSink::BiasGrad), both of which read bf16.
  virtual bool UsesBf16GradOutput() const { return false; }
  // The role whose cast is the first thing the backward does to grad_output, when that cast and
  // the bias gradient (its column sums) are all the backward reads of it (GradOutputCast,
  // GradOutputBiasGrad): it then takes grad_output's FP8 codes as they arrive and column sums
  // given with them. nullopt: it reads grad_output otherwise.
  virtual std::optional<size_t> Fp8GradOutputRole() const { return std::nullopt; }
  // Whether the backward's grad_input is its dgrad GEMM's output as it is, so that it writes it
  // into KindBackwardArgs::grad_input_into (a LayerNorm kind's goes on through the LayerNorm's
  // backward). Every kind's forward output is its last GEMM's and takes output_into.
  virtual bool DgradIsGradInput() const { return false; }
  virtual absl::StatusOr<KindForwardResult> Forward(const KindForwardArgs& args) const = 0;
  virtual absl::StatusOr<KindBackwardResult> Backward(const KindBackwardArgs& args) const = 0;
  // A batch of backwards: one saved state stacking `parts` (contexts of this kind and of one
  // weight workspace) by rows, in order, row-grouped, for a Backward whose grad_output stacks the
  // requests' gradients the same way. Null when they cannot run together (a checkpointed context
  // recomputes its forward with its own casts; a part of another kind or workspace). The parts
  // stay their contexts'.
  virtual std::shared_ptr<SavedTensors> StackSaved(
      const std::vector<const SavedTensors*>& /*parts*/) const {
    return nullptr;
  }
};

// A backward's first cast of grad_output, the cast of `role` (the kind's Fp8GradOutputRole): the
// codes as they arrived (args.grad_output_fp8; a batch's recorded as one step per request, as
// CastRows records the casts it makes) or CastRows of args.grad_output with `usage`.
absl::StatusOr<Fp8Tensor> GradOutputCast(const Backend& b, const KindBackwardArgs& args,
                                         size_t role, CastUsage usage);
// The bias gradient of `p` that grad_output gives: the column sums the requests sent
// (args.grad_output_sums), or grad_output's own, bounded by its cast `dy`.
void GradOutputBiasGrad(const Backend& b, const KindBackwardArgs& args, Param p,
                        const Fp8Tensor& dy);

// The registry: the kind object of `kind`, or null for a value outside the enum (a spec read back
// from a damaged checkpoint).
const ModuleKindOps* FindKind(ModuleKind kind);
// Every kind, in enum order.
const std::vector<const ModuleKindOps*>& Kinds();
// The kind whose spec_name() is `name`, or null.
const ModuleKindOps* FindKindBySpecName(absl::string_view name);
// The kind objects, defined next to their compute functions.
const ModuleKindOps& LinearKind();
const ModuleKindOps& LayerNormLinearKind();
const ModuleKindOps& LayerNormMlpKind();

}  // namespace gradwire::core
