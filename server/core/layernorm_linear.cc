#include "server/core/layernorm_linear.h"

#include <ATen/ATen.h>

#include "gradwire/kernels/ref/layernorm.h"
#include "server/core/kind_common.h"
#include "server/core/module_kind.h"
#include "server/core/status_macros.h"

namespace gradwire::core {

LayerNormOut RunLayerNorm(const at::Tensor& x, const LayerNormParams& ln) {
  const int64_t m = x.size(0), k = x.size(1);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  LayerNormOut out{at::empty({m, k}, f32), at::empty({m}, f32), at::empty({m}, f32)};
  kernels::LayerNormForward(x.data_ptr<float>(), m, k, ln.gamma.data_ptr<float>(),
                            ln.beta.data_ptr<float>(), ln.eps, ln.zero_centered_gamma,
                            out.y.data_ptr<float>(), out.mu.data_ptr<float>(),
                            out.rstd.data_ptr<float>());
  return out;
}

at::Tensor RunLayerNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mu,
                                const at::Tensor& rstd, const LayerNormParams& ln,
                                at::Tensor& gamma_grad, at::Tensor& beta_grad) {
  at::Tensor dx = at::empty_like(x);
  kernels::LayerNormBackward(dy.data_ptr<float>(), x.data_ptr<float>(), mu.data_ptr<float>(),
                             rstd.data_ptr<float>(), ln.gamma.data_ptr<float>(), x.size(0),
                             x.size(1), ln.zero_centered_gamma, dx.data_ptr<float>(),
                             gamma_grad.data_ptr<float>(), beta_grad.data_ptr<float>());
  return dx;
}

int64_t LayerNormLinearSaved::bytes() const {
  return input.numel() * 4 + mu.numel() * 4 + rstd.numel() * 4 + ln_out.bytes();
}

absl::StatusOr<LayerNormLinearFwdResult> LayerNormLinearForward(
    const LayerNormLinearFwdArgs& args) {
  const Backend& b = BackendOr(args.backend);
  LayerNormLinearFwdResult result;
  GW_ASSIGN_OR_RETURN(
      WorkspaceResult ws,
      GetOrBuildWorkspace(b, args.workspace, args.weight_version, args.training, {args.weight},
                          {args.weight_quantizer}, {args.ln.gamma, args.ln.beta}));
  result.workspace = std::move(ws.workspace);
  result.workspace_built = ws.built;
  LayerNormOut ln = b.LayerNormForward(args.input, args.ln);
  const bool keep_columnwise = args.training && !args.checkpoint;
  GW_ASSIGN_OR_RETURN(Fp8Tensor x, b.Cast(ln.y, args.input_quantizer, {true, keep_columnwise}));
  const Fp8Tensor& w = result.workspace->weights[0];
  result.output = b.Fprop(x, w, args.bias);
  result.input_amax = x.amax;
  result.weight_amax = w.amax;
  if (args.return_layernorm_output) result.layernorm_output = ln.y;
  if (args.training) {
    auto saved = std::make_shared<LayerNormLinearSaved>();
    saved->input = args.input.clone();  // own it: the request's bytes do not outlive the call
    saved->mu = ln.mu;
    saved->rstd = ln.rstd;
    saved->input_quantizer = ReplayOf(args.input_quantizer, x);
    if (keep_columnwise) {
      x.rowwise = at::Tensor();
      saved->ln_out = std::move(x);
    }
    saved->workspace = PinForBackward(result.workspace);
    result.saved = std::move(saved);
  }
  return result;
}

absl::StatusOr<LayerNormLinearBwdResult> LayerNormLinearBackward(
    const LayerNormLinearBwdArgs& args) {
  const Backend& b = BackendOr(args.backend);
  const LayerNormLinearSaved& saved = *args.saved;
  const Fp8Tensor w = BackwardWeight(*saved.workspace, 0);
  // The LayerNorm parameters of the forward's weight version.
  LayerNormParams ln = args.ln;
  ln.gamma = saved.workspace->aux[0];
  ln.beta = saved.workspace->aux[1];
  Fp8Tensor recomputed;
  const Fp8Tensor* ln_out = &saved.ln_out;
  if (!saved.ln_out.has_columnwise()) {  // checkpointed: redo LayerNorm and its cast
    LayerNormOut again = b.LayerNormForward(saved.input, ln);
    GW_ASSIGN_OR_RETURN(recomputed, b.Cast(again.y, saved.input_quantizer, {false, true}));
    ln_out = &recomputed;
  }
  GW_ASSIGN_OR_RETURN(Fp8Tensor dy, b.Cast(args.grad_output, args.grad_quantizer, {true, true}));
  LayerNormLinearBwdResult result;
  result.grad_output_amax = dy.amax;
  at::Tensor d_ln = b.Dgrad(dy, w);  // LayerNorm's parameters need it even without grad_input
  if (args.grad_layernorm_output.defined()) b.AddAbsMax(d_ln, args.grad_layernorm_output, d_ln);
  args.grads->Wgrad(Param::kWeight, dy, *ln_out);
  if (args.bias) args.grads->BiasGrad(Param::kBias, args.grad_output, dy.amax);
  const int64_t k = saved.input.size(1);
  at::Tensor gamma_grad = b.Zeros({k}), beta_grad = b.Zeros({k});
  at::Tensor dx =
      b.LayerNormBackward(d_ln, saved.input, saved.mu, saved.rstd, ln, gamma_grad, beta_grad);
  args.grads->Add(Param::kLayerNormWeight, gamma_grad);
  args.grads->Add(Param::kLayerNormBias, beta_grad);
  if (args.compute_grad_input) result.grad_input = dx;
  return result;
}

namespace {

// LayerNormLinear as a module kind: LayerNorm gamma/beta [K], weight [N, K], bias [N]; roles
// input (the LayerNorm output's cast), weight, grad_output.
class LayerNormLinearKindOps final : public ModuleKindOps {
 public:
  enum Role : size_t { kInput, kWeightRole, kGradOutput };

  ModuleKind kind() const override { return ModuleKind::kLayerNormLinear; }
  const char* name() const override { return "LayerNormLinear"; }
  std::vector<ParamDef> Params(const ModuleSpec& s) const override {
    const int64_t k = s.in_features, n = s.out_features;
    std::vector<ParamDef> defs = LayerNormParamDefs(s);
    defs.push_back({Param::kWeight, {n, k}, ParamDef::Init::kUniform, k});
    if (s.bias) defs.push_back({Param::kBias, {n}, ParamDef::Init::kUniform, k});
    return defs;
  }
  const std::vector<RoleDef>& Roles() const override { return SingleGemmRoles(); }
  absl::Status Validate(const ModuleSpec& s) const override { return CheckNoMlpFields(s); }
  std::vector<std::pair<const char*, int64_t>> BuiltWidths(const ModuleSpec& s) const override {
    return {{"the output", s.out_features}};
  }

  absl::StatusOr<KindForwardResult> Forward(const KindForwardArgs& a) const override {
    const std::vector<QuantizerConfig>& q = *a.quantizers;
    const ParamTable& p = *a.params;
    LayerNormLinearFwdArgs args;
    args.backend = a.backend;
    args.input = a.input;
    args.ln = LayerNormOf(p, *a.spec);
    args.weight = p[Param::kWeight];
    args.bias = p[Param::kBias];
    args.weight_version = a.weight_version;
    args.workspace = a.workspace;
    args.input_quantizer = q[kInput];
    args.weight_quantizer = q[kWeightRole];
    args.training = a.training;
    args.return_layernorm_output = a.spec->return_layernorm_output;
    args.checkpoint = a.spec->checkpoint;
    GW_ASSIGN_OR_RETURN(LayerNormLinearFwdResult r, LayerNormLinearForward(args));
    KindForwardResult out;
    out.output = std::move(r.output);
    out.layernorm_output = std::move(r.layernorm_output);
    out.workspace = std::move(r.workspace);
    out.workspace_built = r.workspace_built;
    out.saved = std::move(r.saved);
    out.amaxes = {{kInput, r.input_amax}, {kWeightRole, r.weight_amax}};
    return out;
  }

  absl::StatusOr<KindBackwardResult> Backward(const KindBackwardArgs& a) const override {
    LayerNormLinearBwdArgs args;
    args.backend = a.backend;
    args.grad_output = a.grad_output;
    args.grad_layernorm_output = a.grad_layernorm_output;
    args.saved = dynamic_cast<const LayerNormLinearSaved*>(a.saved);
    if (args.saved == nullptr) return absl::InternalError("context is not a LayerNormLinear one");
    args.ln = LayerNormOf(*a.params, *a.spec);
    args.grad_quantizer = (*a.quantizers)[kGradOutput];
    args.compute_grad_input = a.compute_grad_input;
    args.bias = a.spec->bias;
    args.grads = a.grads;
    GW_ASSIGN_OR_RETURN(LayerNormLinearBwdResult r, LayerNormLinearBackward(args));
    return KindBackwardResult{std::move(r.grad_input), INFINITY,
                              {{kGradOutput, r.grad_output_amax}}};
  }
};

}  // namespace

const ModuleKindOps& LayerNormLinearKind() {
  static const LayerNormLinearKindOps kind;
  return kind;
}

}  // namespace gradwire::core
