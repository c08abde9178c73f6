#include "server/core/kinds/linear.h"

#include <ATen/ATen.h>

#include "server/common/status_macros.h"

namespace gradwire::core {

const std::vector<RoleDef>& SingleGemmRoles() {
  static const std::vector<RoleDef> roles = {{"input", kernels::Fp8Format::kE4M3},
                                             {"weight", kernels::Fp8Format::kE4M3, true},
                                             {"grad_output", kernels::Fp8Format::kE5M2}};
  return roles;
}

absl::StatusOr<KindForwardResult> LinearForward(const KindForwardArgs& args) {
  const at::Tensor& weight = args.params[Param::kWeight];
  if (weight.size(1) != args.input.size(1)) {
    return absl::InternalError("LinearForward: K mismatch");
  }
  // FP8 input codes come only where they are what this module's input cast would make
  // (device::CodesServeInput): one scale for a per-tensor recipe; the recipe's blocks, both
  // copies in training, for a block-scaled one.
  const Fp8Tensor* codes = args.input_fp8;
  if (codes != nullptr) {
    const Fp8Tensor& first = codes->grouped() ? codes->groups[0] : *codes;  // a batch's: alike
    if (codes->rows != args.input.size(0) || codes->cols != args.input.size(1) ||
        first.block_scaled != args.quantizers[kInputRole].block_scaled ||
        (args.training && first.block_scaled && !first.has_columnwise())) {
      return absl::InternalError("Forward: FP8 input codes do not serve this module's input cast");
    }
  }
  const Backend& b = BackendOr(args.backend);
  KindForwardResult result;
  GW_ASSIGN_OR_RETURN(WorkspaceResult ws,
                      GetOrBuildWorkspace(b, args.workspace, args.weight_version, args.training,
                                          {weight}, {args.quantizers[kWeightRole]}));
  result.workspace = std::move(ws.workspace);
  result.workspace_built = ws.built;
  // Training keeps X^T for wgrad; the rowwise copy only lives for this GEMM.
  Fp8Tensor x;
  if (codes != nullptr) {
    x = *codes;
    // Codes that arrived cast are this forward's input casts: a batch's steps record one per
    // request, as CastRows records the casts it makes.
    if (const auto& steps = args.quantizers[kInputRole].steps) {
      if (x.grouped()) {
        for (const Fp8Tensor& g : x.groups) steps->Stepped(g.scalars);
      } else {
        steps->Stepped(x.scalars);
      }
    }
  } else {
    GW_ASSIGN_OR_RETURN(x, CastRows(b, args.input, args.quantizers[kInputRole],
                                    {/*rowwise=*/true, /*columnwise=*/args.training}));
  }
  const Fp8Tensor& w = result.workspace->weights[0];
  result.output = FpropRows(b, x, w, args.params[Param::kBias], args.bf16_output, args.output_into);
  result.amaxes = {{kInputRole, x.scalars}, {kWeightRole, w.scalars}};
  if (args.training) {
    const WorkspacePtr pinned = PinForBackward(result.workspace);
    auto keep = [&](Fp8Tensor input) {
      auto saved = std::make_shared<LinearSaved>();
      input.rowwise = at::Tensor();
      input.rowwise_scale_inv = at::Tensor();
      saved->input = std::move(input);
      saved->workspace = pinned;
      return saved;
    };
    if (x.grouped()) {
      for (Fp8Tensor& g : x.groups) result.saved_groups.push_back(keep(std::move(g)));
    } else {
      result.saved = keep(std::move(x));
    }
  }
  return result;
}

absl::StatusOr<KindBackwardResult> LinearBackward(const KindBackwardArgs& args) {
  const auto* saved = dynamic_cast<const LinearSaved*>(args.saved);
  if (saved == nullptr) return absl::InternalError("context is not a Linear context");
  const Backend& b = BackendOr(args.backend);
  const Fp8Tensor& x = saved->input;  // columnwise X^T [K, M]
  const Fp8Tensor w = BackwardWeight(*saved->workspace, 0);
  if (args.grad_output.size(0) != x.rows || args.grad_output.size(1) != w.rows) {
    return absl::InternalError("LinearBackward: grad_output does not match the saved forward");
  }
  // A batch (row_groups): each request's rows cast on their own, one dgrad over all of them.
  GW_ASSIGN_OR_RETURN(Fp8Tensor dy,
                      GradOutputCast(b, args, kGradOutputRole,
                                     {/*rowwise=*/args.compute_grad_input, /*columnwise=*/true}));
  KindBackwardResult result;
  if (args.compute_grad_input) result.grad_input = DgradRows(b, dy, w, args.grad_input_into);
  args.grads->Wgrad(Param::kWeight, dy, x);
  // dbias from the unquantized gradient, as the fused cast does (|grad_output| <= its amax), or
  // as the request summed it.
  if (args.spec->bias) GradOutputBiasGrad(b, args, Param::kBias, dy);
  // Host values last: a GPU's cast is read back here, after the dgrad GEMM is queued.
  result.amaxes = {{kGradOutputRole, dy.scalars}};
  if (args.compute_grad_input) result.grad_input_bound = [dy, w] { return DgradBound(dy, w); };
  return result;
}

std::shared_ptr<SavedTensors> LinearStackSaved(const std::vector<const SavedTensors*>& parts) {
  const auto* first = parts.empty() ? nullptr : dynamic_cast<const LinearSaved*>(parts[0]);
  if (first == nullptr || !first->workspace) return nullptr;
  std::vector<Fp8Tensor> inputs;
  for (const SavedTensors* part : parts) {
    const auto* one = dynamic_cast<const LinearSaved*>(part);
    if (one == nullptr || one->input.grouped() || one->workspace != first->workspace) {
      return nullptr;
    }
    inputs.push_back(one->input);  // the codes are shared, not copied
  }
  auto out = std::make_shared<LinearSaved>();
  out->input = StackRows(std::move(inputs));
  out->workspace = first->workspace;
  return out;
}

namespace {

// Linear as a module kind: weight [N, K] and bias [N]; roles input, weight, grad_output.
class LinearKindOps final : public ModuleKindOps {
 public:
  ModuleKind kind() const override { return ModuleKind::kLinear; }
  const char* name() const override { return "Linear"; }
  const char* spec_name() const override { return "LINEAR"; }
  SpecFields spec_fields() const override { return {}; }
  std::vector<ParamDef> Params(const ModuleSpec& s) const override {
    const int64_t k = s.in_features, n = s.out_features;
    std::vector<ParamDef> defs = {{Param::kWeight, {n, k}, ParamDef::Init::kUniform, k}};
    if (s.bias) defs.push_back({Param::kBias, {n}, ParamDef::Init::kUniform, k});
    return defs;
  }
  const std::vector<RoleDef>& Roles() const override { return SingleGemmRoles(); }
  std::vector<std::pair<const char*, int64_t>> BuiltWidths(const ModuleSpec& s) const override {
    return {{"the output", s.out_features}};
  }
  bool UsesFp8Input() const override { return true; }
  bool UsesBf16Input() const override { return true; }
  bool UsesBf16GradOutput() const override { return true; }
  std::optional<size_t> Fp8GradOutputRole() const override { return kGradOutputRole; }
  bool DgradIsGradInput() const override { return true; }
  absl::StatusOr<KindForwardResult> Forward(const KindForwardArgs& a) const override {
    return LinearForward(a);
  }
  absl::StatusOr<KindBackwardResult> Backward(const KindBackwardArgs& a) const override {
    return LinearBackward(a);
  }
  std::shared_ptr<SavedTensors> StackSaved(
      const std::vector<const SavedTensors*>& parts) const override {
    return LinearStackSaved(parts);
  }
};

}  // namespace

const ModuleKindOps& LinearKind() {
  static const LinearKindOps kind;
  return kind;
}

}  // namespace gradwire::core
