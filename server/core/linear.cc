#include "server/core/linear.h"

#include <ATen/ATen.h>

#include "server/core/kind_common.h"
#include "server/core/module_kind.h"
#include "server/core/status_macros.h"

namespace gradwire::core {

absl::StatusOr<LinearFwdResult> LinearForward(const LinearFwdArgs& args) {
  if (args.weight.size(1) != args.input.size(1)) {
    return absl::InternalError("LinearForward: K mismatch");
  }
  const Backend& b = BackendOr(args.backend);
  LinearFwdResult result;
  GW_ASSIGN_OR_RETURN(WorkspaceResult ws,
                      GetOrBuildWorkspace(b, args.workspace, args.weight_version, args.training,
                                          {args.weight}, {args.weight_quantizer}));
  result.workspace = std::move(ws.workspace);
  result.workspace_built = ws.built;
  // Training keeps X^T for wgrad; the rowwise copy only lives for this GEMM.
  Fp8Tensor x;
  if (args.input_fp8 != nullptr) {
    x = *args.input_fp8;
  } else {
    GW_ASSIGN_OR_RETURN(x, b.Cast(args.input, args.input_quantizer,
                                  {/*rowwise=*/true, /*columnwise=*/args.training}));
  }
  const Fp8Tensor& w = result.workspace->weights[0];
  result.output = b.Fprop(x, w, args.bias);
  result.input_amax = x.amax;
  result.weight_amax = w.amax;
  if (args.training) {
    x.rowwise = at::Tensor();
    auto saved = std::make_shared<LinearSaved>();
    saved->input = std::move(x);
    saved->workspace = PinForBackward(result.workspace);
    result.saved = std::move(saved);
  }
  return result;
}

absl::StatusOr<LinearBwdResult> LinearBackward(const LinearBwdArgs& args) {
  const Backend& b = BackendOr(args.backend);
  const LinearSaved& saved = *args.saved;
  const Fp8Tensor& x = saved.input;  // columnwise X^T [K, M]
  const Fp8Tensor w = BackwardWeight(*saved.workspace, 0);
  if (args.grad_output.size(0) != x.rows || args.grad_output.size(1) != w.rows) {
    return absl::InternalError("LinearBackward: grad_output does not match the saved forward");
  }
  GW_ASSIGN_OR_RETURN(Fp8Tensor dy, b.Cast(args.grad_output, args.grad_quantizer,
                                           {/*rowwise=*/args.compute_grad_input,
                                            /*columnwise=*/true}));
  LinearBwdResult result;
  result.grad_output_amax = dy.amax;
  if (args.compute_grad_input) {
    result.grad_input = b.Dgrad(dy, w);
    result.grad_input_bound = DgradBound(dy, w);
  }
  args.grads->Wgrad(Param::kWeight, dy, x);
  // dbias from the unquantized gradient, as the fused cast does; |grad_output| <= its amax.
  if (args.bias) args.grads->BiasGrad(Param::kBias, args.grad_output, dy.amax);
  return result;
}

namespace {

// Linear as a module kind: weight [N, K] and bias [N]; roles input, weight, grad_output.
class LinearKindOps final : public ModuleKindOps {
 public:
  enum Role : size_t { kInput, kWeightRole, kGradOutput };

  ModuleKind kind() const override { return ModuleKind::kLinear; }
  const char* name() const override { return "Linear"; }
  std::vector<ParamDef> Params(const ModuleSpec& s) const override {
    const int64_t k = s.in_features, n = s.out_features;
    std::vector<ParamDef> defs = {{Param::kWeight, {n, k}, ParamDef::Init::kUniform, k}};
    if (s.bias) defs.push_back({Param::kBias, {n}, ParamDef::Init::kUniform, k});
    return defs;
  }
  const std::vector<RoleDef>& Roles() const override { return SingleGemmRoles(); }
  absl::Status Validate(const ModuleSpec& s) const override {
    GW_RETURN_IF_ERROR(CheckNoMlpFields(s));
    if (s.zero_centered_gamma || s.return_layernorm_output || s.checkpoint) {
      return absl::InvalidArgumentError(
          "spec.zero_centered_gamma, return_layernorm_output and checkpoint are for the "
          "LayerNorm modules");
    }
    return absl::OkStatus();
  }
  std::vector<std::pair<const char*, int64_t>> BuiltWidths(const ModuleSpec& s) const override {
    return {{"the output", s.out_features}};
  }
  bool UsesFp8Input() const override { return true; }

  absl::StatusOr<KindForwardResult> Forward(const KindForwardArgs& a) const override {
    const std::vector<QuantizerConfig>& q = *a.quantizers;
    LinearFwdArgs args;
    args.backend = a.backend;
    args.input = a.input;
    args.weight = (*a.params)[Param::kWeight];
    args.bias = (*a.params)[Param::kBias];
    args.weight_version = a.weight_version;
    args.workspace = a.workspace;
    args.input_quantizer = q[kInput];
    args.weight_quantizer = q[kWeightRole];
    args.training = a.training;
    if (a.input_fp8 != nullptr) {
      if (a.input_fp8->rows != a.input.size(0) || a.input_fp8->cols != a.input.size(1)) {
        return absl::InternalError("Forward: FP8 input codes do not match the input's shape");
      }
      args.input_fp8 = a.input_fp8;
    }
    GW_ASSIGN_OR_RETURN(LinearFwdResult r, LinearForward(args));
    KindForwardResult out;
    out.output = std::move(r.output);
    out.workspace = std::move(r.workspace);
    out.workspace_built = r.workspace_built;
    out.saved = std::move(r.saved);
    out.amaxes = {{kInput, r.input_amax}, {kWeightRole, r.weight_amax}};
    return out;
  }

  absl::StatusOr<KindBackwardResult> Backward(const KindBackwardArgs& a) const override {
    LinearBwdArgs args;
    args.backend = a.backend;
    args.grad_output = a.grad_output;
    args.saved = dynamic_cast<const LinearSaved*>(a.saved);
    if (args.saved == nullptr) return absl::InternalError("context is not a Linear context");
    args.grad_quantizer = (*a.quantizers)[kGradOutput];
    args.compute_grad_input = a.compute_grad_input;
    args.bias = a.spec->bias;
    args.grads = a.grads;
    GW_ASSIGN_OR_RETURN(LinearBwdResult r, LinearBackward(args));
    return KindBackwardResult{std::move(r.grad_input), r.grad_input_bound,
                              {{kGradOutput, r.grad_output_amax}}};
  }
};

}  // namespace

const ModuleKindOps& LinearKind() {
  static const LinearKindOps kind;
  return kind;
}

}  // namespace gradwire::core
