#include "server/core/kinds/layernorm_mlp.h"

#include <ATen/ATen.h>

#include "server/common/status_macros.h"

namespace gradwire::core {
namespace {

// What the forward computes after LayerNorm, up to FC2's input; kept or recomputed.
struct MlpHidden {
  Fp8Tensor ln_q;      // FC1 input (E4M3): the LayerNorm output's cast
  at::Tensor fc1_out;  // [M, F1]
  Fp8Tensor act_q;     // FC2 input (E4M3)
};

// FC1 from h->ln_q, then the activation and its cast (one fused call where the backend has it).
absl::Status Hidden(const Backend& b, const Fp8Tensor& w1, const at::Tensor& fc1_bias,
                    kernels::Activation act, int64_t ffn, const QuantizerConfig& q2,
                    CastUsage usage, MlpHidden* h) {
  h->fc1_out = FpropRows(b, h->ln_q, w1, fc1_bias);
  GW_ASSIGN_OR_RETURN(h->act_q, ActivationCastRows(b, act, h->fc1_out, ffn, q2, usage, nullptr));
  return absl::OkStatus();
}

}  // namespace

int64_t LayerNormMlpSaved::bytes() const {
  return layernorm_bytes() + (fc1_out.defined() ? fc1_out.numel() : 0) * 4 + ln_out.bytes() +
         act_out.bytes();
}

absl::StatusOr<KindForwardResult> LayerNormMlpForward(const KindForwardArgs& args) {
  const Backend& b = BackendOr(args.backend);
  const ParamTable& p = args.params;
  const std::vector<QuantizerConfig>& q = args.quantizers;
  KindForwardResult result;
  GW_ASSIGN_OR_RETURN(
      WorkspaceResult ws,
      GetOrBuildWorkspace(
          b, args.workspace, args.weight_version, args.training,
          {p[Param::kFc1Weight], p[Param::kFc2Weight]}, {q[kFc1WeightRole], q[kFc2WeightRole]},
          {p[Param::kLayerNormWeight], p[Param::kLayerNormBias], p[Param::kFc1Bias]}));
  result.workspace = std::move(ws.workspace);
  result.workspace_built = ws.built;
  const Fp8Tensor& w1 = result.workspace->weights[0];
  const Fp8Tensor& w2 = result.workspace->weights[1];
  std::shared_ptr<LayerNormMlpSaved> saved;
  if (args.training) saved = std::make_shared<LayerNormMlpSaved>();
  // A batch's contexts copy their own rows below; the whole batch's input is not kept.
  const bool grouped =
      q[kFc1InputRole].row_groups && q[kFc1InputRole].row_groups->size() > 1;  // as CastRows stacks
  const bool keep = args.training && !args.spec->checkpoint;
  LayerNormOut ln;
  MlpHidden h;
  GW_ASSIGN_OR_RETURN(h.ln_q, LayerNormHead(b, args, q[kFc1InputRole], {true, keep}, &result,
                                            grouped ? nullptr : saved.get(), &ln));
  GW_RETURN_IF_ERROR(Hidden(b, w1, p[Param::kFc1Bias], args.spec->activation, w2.cols,
                            q[kFc2InputRole], {true, keep}, &h));
  result.output = FpropRows(b, h.act_q, w2, p[Param::kFc2Bias], args.bf16_output, args.output_into);
  result.amaxes = {{kFc1InputRole, h.ln_q.scalars},
                   {kFc1WeightRole, w1.scalars},
                   {kFc2InputRole, h.act_q.scalars},
                   {kFc2WeightRole, w2.scalars}};
  if (saved && grouped) {  // a batch: each request keeps its own rows
    const WorkspacePtr pinned = PinForBackward(result.workspace, /*needs_rowwise=*/!keep);
    int64_t row = 0;
    for (size_t i = 0; i < h.ln_q.groups.size(); ++i) {
      Fp8Tensor& ln_q = h.ln_q.groups[i];
      Fp8Tensor& act_q = h.act_q.groups.at(i);
      const int64_t rows = ln_q.rows;
      auto one = std::make_shared<LayerNormMlpSaved>();
      one->input = RowsOf(args.input, row, rows);
      one->mu = RowsOf(ln.mu, row, rows);
      one->rstd = RowsOf(ln.rstd, row, rows);
      one->fc1_input_quantizer = ReplayOf(q[kFc1InputRole], ln_q);
      one->fc2_input_quantizer = ReplayOf(q[kFc2InputRole], act_q);
      if (keep) {
        ln_q.rowwise = at::Tensor();
        act_q.rowwise = at::Tensor();
        ln_q.rowwise_scale_inv = at::Tensor();
        act_q.rowwise_scale_inv = at::Tensor();
        one->ln_out = std::move(ln_q);
        one->fc1_out = RowsOf(h.fc1_out, row, rows);
        one->act_out = std::move(act_q);
      }
      row += rows;
      one->workspace = pinned;
      result.saved_groups.push_back(std::move(one));
    }
  } else if (saved) {
    saved->fc1_input_quantizer = ReplayOf(q[kFc1InputRole], h.ln_q);
    saved->fc2_input_quantizer = ReplayOf(q[kFc2InputRole], h.act_q);
    if (keep) {
      h.ln_q.rowwise = at::Tensor();
      h.act_q.rowwise = at::Tensor();
      h.ln_q.rowwise_scale_inv = at::Tensor();
      h.act_q.rowwise_scale_inv = at::Tensor();
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

absl::StatusOr<KindBackwardResult> LayerNormMlpBackward(const KindBackwardArgs& args) {
  const auto* saved = dynamic_cast<const LayerNormMlpSaved*>(args.saved);
  if (saved == nullptr) return absl::InternalError("context is not a LayerNormMLP one");
  const Backend& b = BackendOr(args.backend);
  const kernels::Activation act = args.spec->activation;
  const Fp8Tensor w1 = BackwardWeight(*saved->workspace, 0);
  const Fp8Tensor w2 = BackwardWeight(*saved->workspace, 1);
  const int64_t ffn = w2.cols;
  // The LayerNorm parameters and FC1 bias of the forward's weight version.
  const LayerNormParams ln = SavedLayerNorm(*args.spec, *saved);
  const at::Tensor& fc1_bias = saved->workspace->aux[2];
  MlpHidden recomputed;
  const Fp8Tensor* ln_q = &saved->ln_out;
  const at::Tensor* fc1_out = &saved->fc1_out;
  const Fp8Tensor* act_q = &saved->act_out;
  if (!saved->fc1_out.defined()) {  // checkpointed: replay the forward's exact casts
    GW_ASSIGN_OR_RETURN(recomputed.ln_q,
                        LayerNormCastRows(b, saved->input, ln, saved->fc1_input_quantizer,
                                          {true, true}, /*keep_y=*/false, nullptr));
    GW_RETURN_IF_ERROR(
        Hidden(b, w1, fc1_bias, act, ffn, saved->fc2_input_quantizer, {true, true}, &recomputed));
    ln_q = &recomputed.ln_q;
    fc1_out = &recomputed.fc1_out;
    act_q = &recomputed.act_q;
  }
  KindBackwardResult result;
  // FC2
  // A batch (row_groups): each request's rows cast on their own, each GEMM over all of them.
  GW_ASSIGN_OR_RETURN(Fp8Tensor dy, GradOutputCast(b, args, kFc2GradRole, {true, true}));
  at::Tensor d_act = DgradRows(b, dy, w2);
  args.grads->Wgrad(Param::kFc2Weight, dy, *act_q);
  if (args.spec->bias) GradOutputBiasGrad(b, args, Param::kFc2Bias, dy);
  // Activation
  // and FC1's gradient cast, one fused call where the backend has it; the fp32 gradient is
  // written only for FC1's bias gradient.
  at::Tensor d_fc1;
  GW_ASSIGN_OR_RETURN(
      Fp8Tensor dh, DActivationCastRows(b, act, d_act, *fc1_out, ffn, args.quantizers[kFc1GradRole],
                                        {true, true}, args.spec->bias ? &d_fc1 : nullptr));
  // FC1
  at::Tensor d_ln = DgradRows(b, dh, w1);
  args.grads->Wgrad(Param::kFc1Weight, dh, *ln_q);
  if (args.spec->bias) args.grads->BiasGrad(Param::kFc1Bias, d_fc1, dh);
  result.amaxes = {{kFc1GradRole, dh.scalars}, {kFc2GradRole, dy.scalars}};
  // LayerNorm
  LayerNormTail(b, args, *saved, ln, std::move(d_ln), &result);
  return result;
}

std::shared_ptr<SavedTensors> LayerNormMlpStackSaved(
    const std::vector<const SavedTensors*>& parts) {
  std::vector<const LayerNormSaved*> ln;
  std::vector<Fp8Tensor> ln_out, act_out;
  std::vector<at::Tensor> fc1_out;
  for (const SavedTensors* part : parts) {
    const auto* one = dynamic_cast<const LayerNormMlpSaved*>(part);
    // A checkpointed context recomputes its forward with its own casts: not stacked.
    if (one == nullptr || !one->fc1_out.defined()) return nullptr;
    ln.push_back(one);
    ln_out.push_back(one->ln_out);
    act_out.push_back(one->act_out);
    fc1_out.push_back(one->fc1_out);
  }
  auto out = std::make_shared<LayerNormMlpSaved>();
  if (!StackLayerNorm(ln, out.get())) return nullptr;
  out->ln_out = StackRows(std::move(ln_out));
  out->act_out = StackRows(std::move(act_out));
  out->fc1_out = at::cat(fc1_out, 0);
  return out;
}

namespace {

// LayerNormMLP as a module kind: LayerNorm gamma/beta [K], fc1 [F1, K] (+ bias), fc2 [N, F]
// (+ bias), F1 = 2F for the gated activations. Six roles (MlpRole).
class LayerNormMlpKindOps final : public ModuleKindOps {
 public:
  ModuleKind kind() const override { return ModuleKind::kLayerNormMlp; }
  const char* name() const override { return "LayerNormMLP"; }
  const char* spec_name() const override { return "LAYERNORM_MLP"; }
  SpecFields spec_fields() const override { return {/*ffn=*/true, /*layernorm=*/true}; }
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
  std::vector<std::pair<const char*, int64_t>> BuiltWidths(const ModuleSpec& s) const override {
    return {{"the output", s.out_features}, {"the FC1 output", Fc1Width(s)}};
  }
  bool UsesBf16Input() const override { return true; }
  bool UsesBf16GradOutput() const override { return true; }
  std::optional<size_t> Fp8GradOutputRole() const override { return kFc2GradRole; }
  absl::StatusOr<KindForwardResult> Forward(const KindForwardArgs& a) const override {
    return LayerNormMlpForward(a);
  }
  absl::StatusOr<KindBackwardResult> Backward(const KindBackwardArgs& a) const override {
    return LayerNormMlpBackward(a);
  }
  std::shared_ptr<SavedTensors> StackSaved(
      const std::vector<const SavedTensors*>& parts) const override {
    return LayerNormMlpStackSaved(parts);
  }
};

}  // namespace

const ModuleKindOps& LayerNormMlpKind() {
  static const LayerNormMlpKindOps kind;
  return kind;
}

}  // namespace gradwire::core
