#include "server/core/layernorm_mlp.h"

#include <ATen/ATen.h>

#include "server/core/kind_common.h"
#include "server/core/module_kind.h"
#include "server/core/status_macros.h"

namespace gradwire::core {
namespace {

int64_t FfnWidth(const at::Tensor& fc2_weight) { return fc2_weight.size(1); }

// What the forward computes after LayerNorm, up to FC2's input; kept or recomputed.
struct MlpHidden {
  Fp8Tensor ln_q;      // FC1 input (E4M3)
  at::Tensor fc1_out;  // [M, F1]
  Fp8Tensor act_q;     // FC2 input (E4M3)
};

absl::StatusOr<MlpHidden> Hidden(const Backend& b, const at::Tensor& ln_y, const Fp8Tensor& w1,
                                 const at::Tensor& fc1_bias, kernels::Activation act, int64_t ffn,
                                 const QuantizerConfig& q1, const QuantizerConfig& q2,
                                 CastUsage usage) {
  MlpHidden h;
  GW_ASSIGN_OR_RETURN(h.ln_q, b.Cast(ln_y, q1, usage));
  if (usage.rowwise) {
    h.fc1_out = b.Fprop(h.ln_q, w1, fc1_bias);
    at::Tensor act_out = b.ActivationForward(act, h.fc1_out, ffn);
    GW_ASSIGN_OR_RETURN(h.act_q, b.Cast(act_out, q2, usage));
  }
  return h;
}

}  // namespace

int64_t LayerNormMlpSaved::bytes() const {
  return (input.numel() + mu.numel() + rstd.numel() + (fc1_out.defined() ? fc1_out.numel() : 0)) *
             4 +
         ln_out.bytes() + act_out.bytes();
}

absl::StatusOr<LayerNormMlpFwdResult> LayerNormMlpForward(const LayerNormMlpFwdArgs& args) {
  const Backend& b = BackendOr(args.backend);
  LayerNormMlpFwdResult result;
  GW_ASSIGN_OR_RETURN(WorkspaceResult ws,
                      GetOrBuildWorkspace(b, args.workspace, args.weight_version, args.training,
                                          {args.fc1_weight, args.fc2_weight},
                                          {args.fc1_weight_quantizer, args.fc2_weight_quantizer},
                                          {args.ln.gamma, args.ln.beta, args.fc1_bias}));
  result.workspace = std::move(ws.workspace);
  result.workspace_built = ws.built;
  const Fp8Tensor& w1 = result.workspace->weights[0];
  const Fp8Tensor& w2 = result.workspace->weights[1];
  const int64_t ffn = FfnWidth(args.fc2_weight);
  LayerNormOut ln = b.LayerNormForward(args.input, args.ln);
  const bool keep = args.training && !args.checkpoint;
  GW_ASSIGN_OR_RETURN(MlpHidden h,
                      Hidden(b, ln.y, w1, args.fc1_bias, args.activation, ffn,
                             args.fc1_input_quantizer, args.fc2_input_quantizer, {true, keep}));
  result.output = b.Fprop(h.act_q, w2, args.fc2_bias);
  result.fc1_input_amax = h.ln_q.amax;
  result.fc2_input_amax = h.act_q.amax;
  result.fc1_weight_amax = w1.amax;
  result.fc2_weight_amax = w2.amax;
  if (args.return_layernorm_output) result.layernorm_output = ln.y;
  if (args.training) {
    auto saved = std::make_shared<LayerNormMlpSaved>();
    saved->input = args.input.clone();  // own it: the request's bytes do not outlive the call
    saved->mu = ln.mu;
    saved->rstd = ln.rstd;
    saved->fc1_input_quantizer = ReplayOf(args.fc1_input_quantizer, h.ln_q);
    saved->fc2_input_quantizer = ReplayOf(args.fc2_input_quantizer, h.act_q);
    if (keep) {
      h.ln_q.rowwise = at::Tensor();
      h.act_q.rowwise = at::Tensor();
      saved->ln_out = std::move(h.ln_q);
      saved->fc1_out = std::move(h.fc1_out);
      saved->act_out = std::move(h.act_q);
    }
    // A checkpointed backward recomputes FC1, which reads the rowwise weights.
    saved->workspace = PinForBackward(result.workspace, /*needs_rowwise=*/!keep);
    result.saved = std::move(saved);
  }
  return result;
}

absl::StatusOr<LayerNormMlpBwdResult> LayerNormMlpBackward(const LayerNormMlpBwdArgs& args) {
  const Backend& b = BackendOr(args.backend);
  const LayerNormMlpSaved& saved = *args.saved;
  const Fp8Tensor w1 = BackwardWeight(*saved.workspace, 0);
  const Fp8Tensor w2 = BackwardWeight(*saved.workspace, 1);
  const int64_t ffn = w2.cols;
  // The LayerNorm parameters and FC1 bias of the forward's weight version.
  LayerNormParams ln = args.ln;
  ln.gamma = saved.workspace->aux[0];
  ln.beta = saved.workspace->aux[1];
  const at::Tensor& fc1_bias = saved.workspace->aux[2];
  MlpHidden recomputed;
  const Fp8Tensor* ln_q = &saved.ln_out;
  const at::Tensor* fc1_out = &saved.fc1_out;
  const Fp8Tensor* act_q = &saved.act_out;
  if (!saved.fc1_out.defined()) {  // checkpointed: replay the forward's exact casts
    LayerNormOut again = b.LayerNormForward(saved.input, ln);
    GW_ASSIGN_OR_RETURN(recomputed,
                        Hidden(b, again.y, w1, fc1_bias, args.activation, ffn,
                               saved.fc1_input_quantizer, saved.fc2_input_quantizer, {true, true}));
    ln_q = &recomputed.ln_q;
    fc1_out = &recomputed.fc1_out;
    act_q = &recomputed.act_q;
  }
  LayerNormMlpBwdResult result;
  // FC2
  GW_ASSIGN_OR_RETURN(Fp8Tensor dy,
                      b.Cast(args.grad_output, args.fc2_grad_quantizer, {true, true}));
  result.fc2_grad_amax = dy.amax;
  at::Tensor d_act = b.Dgrad(dy, w2);
  args.grads->Wgrad(Param::kFc2Weight, dy, *act_q);
  if (args.bias) args.grads->BiasGrad(Param::kFc2Bias, args.grad_output, dy.amax);
  // Activation
  at::Tensor d_fc1 = b.ActivationBackward(args.activation, d_act, *fc1_out, ffn);
  // FC1
  GW_ASSIGN_OR_RETURN(Fp8Tensor dh, b.Cast(d_fc1, args.fc1_grad_quantizer, {true, true}));
  result.fc1_grad_amax = dh.amax;
  at::Tensor d_ln = b.Dgrad(dh, w1);
  if (args.grad_layernorm_output.defined()) b.AddAbsMax(d_ln, args.grad_layernorm_output, d_ln);
  args.grads->Wgrad(Param::kFc1Weight, dh, *ln_q);
  if (args.bias) args.grads->BiasGrad(Param::kFc1Bias, d_fc1, dh.amax);
  // LayerNorm
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

// LayerNormMLP as a module kind: LayerNorm gamma/beta [K], fc1 [F1, K] (+ bias), fc2 [N, F]
// (+ bias), F1 = 2F for the gated activations. Six roles: the casts of FC1's and FC2's inputs
// and weights, and of the two gradients coming back.
class LayerNormMlpKindOps final : public ModuleKindOps {
 public:
  enum Role : size_t { kFc1In, kFc1Weight, kFc2In, kFc2Weight, kFc1Grad, kFc2Grad };

  ModuleKind kind() const override { return ModuleKind::kLayerNormMlp; }
  const char* name() const override { return "LayerNormMLP"; }
  static int64_t Fc1Width(const ModuleSpec& s) {
    return kernels::IsGated(s.activation) ? 2 * s.ffn_features : s.ffn_features;
  }
  std::vector<ParamDef> Params(const ModuleSpec& s) const override {
    const int64_t k = s.in_features, n = s.out_features, f = s.ffn_features, f1 = Fc1Width(s);
    std::vector<ParamDef> defs = LayerNormParamDefs(s);
    defs.push_back({Param::kFc1Weight, {f1, k}, ParamDef::Init::kUniform, k});
    if (s.bias) defs.push_back({Param::kFc1Bias, {f1}, ParamDef::Init::kUniform, k});
    defs.push_back({Param::kFc2Weight, {n, f}, ParamDef::Init::kUniform, f});
    if (s.bias) defs.push_back({Param::kFc2Bias, {n}, ParamDef::Init::kUniform, f});
    return defs;
  }
  const std::vector<RoleDef>& Roles() const override {
    using kernels::Fp8Format;
    static const std::vector<RoleDef> roles = {
        {"fc1_input", Fp8Format::kE4M3},       {"fc1_weight", Fp8Format::kE4M3, true},
        {"fc2_input", Fp8Format::kE4M3},       {"fc2_weight", Fp8Format::kE4M3, true},
        {"fc1_grad_output", Fp8Format::kE5M2}, {"fc2_grad_output", Fp8Format::kE5M2}};
    return roles;
  }
  absl::Status Validate(const ModuleSpec& s) const override {
    return CheckSpecRange("spec.ffn_features", s.ffn_features, 1, kMaxFeatures);
  }
  std::vector<std::pair<const char*, int64_t>> BuiltWidths(const ModuleSpec& s) const override {
    return {{"the output", s.out_features}, {"the FC1 output", Fc1Width(s)}};
  }

  absl::StatusOr<KindForwardResult> Forward(const KindForwardArgs& a) const override {
    const std::vector<QuantizerConfig>& q = *a.quantizers;
    const ParamTable& p = *a.params;
    LayerNormMlpFwdArgs args;
    args.backend = a.backend;
    args.input = a.input;
    args.ln = LayerNormOf(p, *a.spec);
    args.fc1_weight = p[Param::kFc1Weight];
    args.fc1_bias = p[Param::kFc1Bias];
    args.fc2_weight = p[Param::kFc2Weight];
    args.fc2_bias = p[Param::kFc2Bias];
    args.activation = a.spec->activation;
    args.weight_version = a.weight_version;
    args.workspace = a.workspace;
    args.fc1_input_quantizer = q[kFc1In];
    args.fc1_weight_quantizer = q[kFc1Weight];
    args.fc2_input_quantizer = q[kFc2In];
    args.fc2_weight_quantizer = q[kFc2Weight];
    args.training = a.training;
    args.return_layernorm_output = a.spec->return_layernorm_output;
    args.checkpoint = a.spec->checkpoint;
    GW_ASSIGN_OR_RETURN(LayerNormMlpFwdResult r, LayerNormMlpForward(args));
    KindForwardResult out;
    out.output = std::move(r.output);
    out.layernorm_output = std::move(r.layernorm_output);
    out.workspace = std::move(r.workspace);
    out.workspace_built = r.workspace_built;
    out.saved = std::move(r.saved);
    out.amaxes = {{kFc1In, r.fc1_input_amax},
                  {kFc1Weight, r.fc1_weight_amax},
                  {kFc2In, r.fc2_input_amax},
                  {kFc2Weight, r.fc2_weight_amax}};
    return out;
  }

  absl::StatusOr<KindBackwardResult> Backward(const KindBackwardArgs& a) const override {
    const std::vector<QuantizerConfig>& q = *a.quantizers;
    LayerNormMlpBwdArgs args;
    args.backend = a.backend;
    args.grad_output = a.grad_output;
    args.grad_layernorm_output = a.grad_layernorm_output;
    args.saved = dynamic_cast<const LayerNormMlpSaved*>(a.saved);
    if (args.saved == nullptr) return absl::InternalError("context is not a LayerNormMLP one");
    args.ln = LayerNormOf(*a.params, *a.spec);
    args.activation = a.spec->activation;
    args.fc1_grad_quantizer = q[kFc1Grad];
    args.fc2_grad_quantizer = q[kFc2Grad];
    args.compute_grad_input = a.compute_grad_input;
    args.bias = a.spec->bias;
    args.grads = a.grads;
    GW_ASSIGN_OR_RETURN(LayerNormMlpBwdResult r, LayerNormMlpBackward(args));
    return KindBackwardResult{std::move(r.grad_input), INFINITY,
                              {{kFc1Grad, r.fc1_grad_amax}, {kFc2Grad, r.fc2_grad_amax}}};
  }
};

}  // namespace

const ModuleKindOps& LayerNormMlpKind() {
  static const LayerNormMlpKindOps kind;
  return kind;
}

}  // namespace gradwire::core
