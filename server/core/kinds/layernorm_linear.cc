#include "server/core/kinds/layernorm_linear.h"

#include <ATen/ATen.h>

#include "server/common/status_macros.h"
#include "server/core/kinds/linear.h"

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

absl::StatusOr<Fp8Tensor> LayerNormHead(const Backend& b, const KindForwardArgs& args,
                                        const QuantizerConfig& config, CastUsage usage,
                                        KindForwardResult* result, LayerNormSaved* saved,
                                        LayerNormOut* ln) {
  const bool keep_y = args.spec->return_layernorm_output;
  // A bf16 input is read as it came (LayerNorm takes its exact widening) and kept so for the
  // backward (half the bytes).
  GW_ASSIGN_OR_RETURN(Fp8Tensor x,
                      LayerNormCastRows(b, args.input, LayerNormOf(args.params, *args.spec), config,
                                        usage, keep_y, ln));
  if (keep_y) result->layernorm_output = ln->y;
  if (saved != nullptr) {
    saved->input = args.input.clone();  // own it: the request's bytes do not outlive the call
    saved->mu = ln->mu;
    saved->rstd = ln->rstd;
  }
  return x;
}

LayerNormParams SavedLayerNorm(const ModuleSpec& spec, const LayerNormSaved& saved) {
  return LayerNormParams{saved.workspace->aux[0], saved.workspace->aux[1], spec.layernorm_eps,
                         spec.zero_centered_gamma};
}

void LayerNormTail(const Backend& b, const KindBackwardArgs& args, const LayerNormSaved& saved,
                   const LayerNormParams& ln, at::Tensor d_ln, KindBackwardResult* result) {
  // A plain add: AddAbsMax would read its max back (on a GPU, a wait for nothing).
  if (args.grad_layernorm_output.defined()) d_ln.add_(args.grad_layernorm_output);
  const int64_t k = saved.input.size(1);
  // A batch: gamma's and beta's gradients are each request's own sums, so each request's rows go
  // through the LayerNorm backward on their own.
  const std::vector<int64_t> one = {saved.input.size(0)};
  const std::vector<int64_t>& groups = args.row_groups ? *args.row_groups : one;
  std::vector<at::Tensor> dx;
  int64_t row = 0;
  for (size_t j = 0; j < groups.size(); ++j) {
    const int64_t rows = groups[j];
    auto part = [&](const at::Tensor& t) {
      return groups.size() == 1 ? t : t.narrow(0, row, rows);
    };
    at::Tensor gamma_grad = b.Zeros({k}), beta_grad = b.Zeros({k});
    dx.push_back(b.LayerNormBackward(part(d_ln), part(saved.input), part(saved.mu),
                                     part(saved.rstd), ln, gamma_grad, beta_grad));
    args.grads->Add(Param::kLayerNormWeight, gamma_grad, j);
    args.grads->Add(Param::kLayerNormBias, beta_grad, j);
    row += rows;
  }
  if (args.compute_grad_input) result->grad_input = dx.size() == 1 ? dx[0] : at::cat(dx, 0);
}

bool StackLayerNorm(const std::vector<const LayerNormSaved*>& parts, LayerNormSaved* out) {
  if (parts.empty()) return false;
  std::vector<at::Tensor> input, mu, rstd;
  for (const LayerNormSaved* p : parts) {
    if (p == nullptr || !p->workspace || p->workspace != parts[0]->workspace) return false;
    input.push_back(p->input);
    mu.push_back(p->mu);
    rstd.push_back(p->rstd);
  }
  // Inputs kept as bf16 and as fp32 stack widened (exact: LayerNorm reads a bf16 input as its
  // widening, so a mixed batch's widened stack gives the same bits).
  bool mixed = false;
  for (const at::Tensor& t : input) mixed = mixed || t.scalar_type() != input[0].scalar_type();
  if (mixed) {
    for (at::Tensor& t : input) t = t.to(at::kFloat);
  }
  out->input = at::cat(input, 0);
  out->mu = at::cat(mu, 0);
  out->rstd = at::cat(rstd, 0);
  out->workspace = parts[0]->workspace;
  return true;
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
  const bool keep_columnwise = args.training && !args.spec->checkpoint;
  LayerNormOut ln;
  GW_ASSIGN_OR_RETURN(Fp8Tensor x, LayerNormHead(b, args, q, {true, keep_columnwise}, &result,
                                                 grouped ? nullptr : saved.get(), &ln));
  const Fp8Tensor& w = result.workspace->weights[0];
  result.output = FpropRows(b, x, w, p[Param::kBias], args.bf16_output, args.output_into);
  result.amaxes = {{kInputRole, x.scalars}, {kWeightRole, w.scalars}};
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
        g.rowwise_scale_inv = at::Tensor();
        one->ln_out = std::move(g);
      }
      one->workspace = PinForBackward(result.workspace);
      result.saved_groups.push_back(std::move(one));
    }
  } else if (saved) {
    saved->input_quantizer = ReplayOf(q, x);
    if (keep_columnwise) {
      x.rowwise = at::Tensor();
      x.rowwise_scale_inv = at::Tensor();
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
  // Checkpointed: redo LayerNorm and its cast (a batch's stacked state is never checkpointed).
  if (!saved->ln_out.has_columnwise() && !saved->ln_out.grouped()) {
    GW_ASSIGN_OR_RETURN(recomputed, b.LayerNormCast(saved->input, ln, saved->input_quantizer,
                                                    {false, true}, /*keep_y=*/false, nullptr));
    ln_out = &recomputed;
  }
  GW_ASSIGN_OR_RETURN(Fp8Tensor dy, GradOutputCast(b, args, kGradOutputRole, {true, true}));
  KindBackwardResult result;
  at::Tensor d_ln = DgradRows(b, dy, w);  // LayerNorm's parameters need it without grad_input too
  args.grads->Wgrad(Param::kWeight, dy, *ln_out);
  if (args.spec->bias) GradOutputBiasGrad(b, args, Param::kBias, dy);
  // Host values after the dgrad GEMM is queued (a GPU's cast is read back here).
  result.amaxes = {{kGradOutputRole, dy.scalars}};
  LayerNormTail(b, args, *saved, ln, std::move(d_ln), &result);
  return result;
}

std::shared_ptr<SavedTensors> LayerNormLinearStackSaved(
    const std::vector<const SavedTensors*>& parts) {
  std::vector<const LayerNormSaved*> ln;
  std::vector<Fp8Tensor> ln_out;
  for (const SavedTensors* part : parts) {
    const auto* one = dynamic_cast<const LayerNormLinearSaved*>(part);
    // A checkpointed context recomputes its cast: not stacked.
    if (one == nullptr || !one->ln_out.has_columnwise()) return nullptr;
    ln.push_back(one);
    ln_out.push_back(one->ln_out);
  }
  auto out = std::make_shared<LayerNormLinearSaved>();
  if (!StackLayerNorm(ln, out.get())) return nullptr;
  out->ln_out = StackRows(std::move(ln_out));
  return out;
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
  bool UsesBf16Input() const override { return true; }
  bool UsesBf16GradOutput() const override { return true; }
  std::optional<size_t> Fp8GradOutputRole() const override { return kGradOutputRole; }
  absl::StatusOr<KindForwardResult> Forward(const KindForwardArgs& a) const override {
    return LayerNormLinearForward(a);
  }
  absl::StatusOr<KindBackwardResult> Backward(const KindBackwardArgs& a) const override {
    return LayerNormLinearBackward(a);
  }
  std::shared_ptr<SavedTensors> StackSaved(
      const std::vector<const SavedTensors*>& parts) const override {
    return LayerNormLinearStackSaved(parts);
  }
};

}  // namespace

const ModuleKindOps& LayerNormLinearKind() {
  static const LayerNormLinearKindOps kind;
  return kind;
}

}  // namespace gradwire::core
