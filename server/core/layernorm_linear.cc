#include "server/core/layernorm_linear.h"

#include <ATen/ATen.h>

#include "server/core/linear.h"
#include "server/core/status_macros.h"

namespace gradwire::core {

std::vector<ParamDef> LayerNormParamDefs(const ModuleSpec& s) {
  const int64_t k = s.in_features;
  return {{Param::kLayerNormWeight,
           {k},
           s.zero_centered_gamma ? ParamDef::Init::kZeros : ParamDef::Init::kOnes},
          {Param::kLayerNormBias, {k}, ParamDef::Init::kZeros}};
}

LayerNormParams LayerNormOf(const ParamTable& p, const ModuleSpec& s) {
  return LayerNormParams{p[Param::kLayerNormWeight], p[Param::kLayerNormBias], s.layernorm_eps,
                         s.zero_centered_gamma};
}

LayerNormOut LayerNormHead(const Backend& b, const KindForwardArgs& args, KindForwardResult* result,
                           LayerNormSaved* saved) {
  LayerNormOut ln = b.LayerNormForward(args.input, LayerNormOf(args.params, *args.spec));
  if (args.spec->return_layernorm_output) result->layernorm_output = ln.y;
  if (saved != nullptr) {
    saved->input = args.input.clone();  // own it: the request's bytes do not outlive the call
    saved->mu = ln.mu;
    saved->rstd = ln.rstd;
  }
  return ln;
}

LayerNormParams SavedLayerNorm(const ModuleSpec& spec, const LayerNormSaved& saved) {
  return LayerNormParams{saved.workspace->aux[0], saved.workspace->aux[1], spec.layernorm_eps,
                         spec.zero_centered_gamma};
}

void LayerNormTail(const Backend& b, const KindBackwardArgs& args, const LayerNormSaved& saved,
                   const LayerNormParams& ln, at::Tensor d_ln, KindBackwardResult* result) {
  if (args.grad_layernorm_output.defined()) b.AddAbsMax(d_ln, args.grad_layernorm_output, d_ln);
  const int64_t k = saved.input.size(1);
  at::Tensor gamma_grad = b.Zeros({k}), beta_grad = b.Zeros({k});
  at::Tensor dx =
      b.LayerNormBackward(d_ln, saved.input, saved.mu, saved.rstd, ln, gamma_grad, beta_grad);
  args.grads->Add(Param::kLayerNormWeight, gamma_grad);
  args.grads->Add(Param::kLayerNormBias, beta_grad);
  if (args.compute_grad_input) result->grad_input = dx;
}

absl::StatusOr<KindForwardResult> LayerNormLinearForward(const KindForwardArgs& args) {
  const Backend& b = BackendOr(args.backend);
  const ParamTable& p = args.params;
  KindForwardResult result;
  GW_ASSIGN_OR_RETURN(WorkspaceResult ws,
                      GetOrBuildWorkspace(b, args.workspace, args.weight_version, args.training,
                                          {p[Param::kWeight]}, {args.quantizers[kWeightRole]},
                                          {p[Param::kLayerNormWeight], p[Param::kLayerNormBias]}));
  result.workspace = std::move(ws.workspace);
  result.workspace_built = ws.built;
  std::shared_ptr<LayerNormLinearSaved> saved;
  if (args.training) saved = std::make_shared<LayerNormLinearSaved>();
  const QuantizerConfig& q = args.quantizers[kInputRole];
  // A batch's contexts copy their own rows below; the whole batch's input is not kept.
  const bool grouped = q.row_groups && q.row_groups->size() > 1;  // as CastRows stacks them
  const LayerNormOut ln = LayerNormHead(b, args, &result, grouped ? nullptr : saved.get());
  const bool keep_columnwise = args.training && !args.spec->checkpoint;
  GW_ASSIGN_OR_RETURN(Fp8Tensor x, CastRows(b, ln.y, q, {true, keep_columnwise}));
  const Fp8Tensor& w = result.workspace->weights[0];
  result.output = FpropRows(b, x, w, p[Param::kBias]);
  result.amaxes = {{kInputRole, x.amax}, {kWeightRole, w.amax}};
  if (saved && grouped) {  // a batch: each request keeps its own rows
    int64_t row = 0;
    for (Fp8Tensor& g : x.groups) {
      auto one = std::make_shared<LayerNormLinearSaved>();
      one->input = RowsOf(args.input, row, g.rows);
      one->mu = RowsOf(ln.mu, row, g.rows);
      one->rstd = RowsOf(ln.rstd, row, g.rows);
      one->input_quantizer = ReplayOf(q, g);
      row += g.rows;
      if (keep_columnwise) {
        g.rowwise = at::Tensor();
        one->ln_out = std::move(g);
      }
      one->workspace = PinForBackward(result.workspace);
      result.saved_groups.push_back(std::move(one));
    }
  } else if (saved) {
    saved->input_quantizer = ReplayOf(q, x);
    if (keep_columnwise) {
      x.rowwise = at::Tensor();
      saved->ln_out = std::move(x);
    }
    saved->workspace = PinForBackward(result.workspace);
    result.saved = std::move(saved);
  }
  return result;
}

absl::StatusOr<KindBackwardResult> LayerNormLinearBackward(const KindBackwardArgs& args) {
  const auto* saved = dynamic_cast<const LayerNormLinearSaved*>(args.saved);
  if (saved == nullptr) return absl::InternalError("context is not a LayerNormLinear one");
  const Backend& b = BackendOr(args.backend);
  const Fp8Tensor w = BackwardWeight(*saved->workspace, 0);
  const LayerNormParams ln = SavedLayerNorm(*args.spec, *saved);
  Fp8Tensor recomputed;
  const Fp8Tensor* ln_out = &saved->ln_out;
  if (!saved->ln_out.has_columnwise()) {  // checkpointed: redo LayerNorm and its cast
    LayerNormOut again = b.LayerNormForward(saved->input, ln);
    GW_ASSIGN_OR_RETURN(recomputed, b.Cast(again.y, saved->input_quantizer, {false, true}));
    ln_out = &recomputed;
  }
  GW_ASSIGN_OR_RETURN(Fp8Tensor dy,
                      b.Cast(args.grad_output, args.quantizers[kGradOutputRole], {true, true}));
  KindBackwardResult result;
  result.amaxes = {{kGradOutputRole, dy.amax}};
  at::Tensor d_ln = b.Dgrad(dy, w);  // LayerNorm's parameters need it even without grad_input
  args.grads->Wgrad(Param::kWeight, dy, *ln_out);
  if (args.spec->bias) args.grads->BiasGrad(Param::kBias, args.grad_output, dy.amax);
  LayerNormTail(b, args, *saved, ln, std::move(d_ln), &result);
  return result;
}

namespace {

// LayerNormLinear as a module kind: LayerNorm gamma/beta [K], weight [N, K], bias [N]; roles
// input (the LayerNorm output's cast), weight, grad_output.
class LayerNormLinearKindOps final : public ModuleKindOps {
 public:
  ModuleKind kind() const override { return ModuleKind::kLayerNormLinear; }
  const char* name() const override { return "LayerNormLinear"; }
  const char* spec_name() const override { return "LAYERNORM_LINEAR"; }
  SpecFields spec_fields() const override { return {/*ffn=*/false, /*layernorm=*/true}; }
  std::vector<ParamDef> Params(const ModuleSpec& s) const override {
    const int64_t k = s.in_features, n = s.out_features;
    std::vector<ParamDef> defs = LayerNormParamDefs(s);
    defs.push_back({Param::kWeight, {n, k}, ParamDef::Init::kUniform, k});
    if (s.bias) defs.push_back({Param::kBias, {n}, ParamDef::Init::kUniform, k});
    return defs;
  }
  const std::vector<RoleDef>& Roles() const override { return SingleGemmRoles(); }
  std::vector<std::pair<const char*, int64_t>> BuiltWidths(const ModuleSpec& s) const override {
    return {{"the output", s.out_features}};
  }
  absl::StatusOr<KindForwardResult> Forward(const KindForwardArgs& a) const override {
    return LayerNormLinearForward(a);
  }
  absl::StatusOr<KindBackwardResult> Backward(const KindBackwardArgs& a) const override {
    return LayerNormLinearBackward(a);
  }
};

}  // namespace

const ModuleKindOps& LayerNormLinearKind() {
  static const LayerNormLinearKindOps kind;
  return kind;
}

}  // namespace gradwire::core
