#include "server/core/kinds/fp8_ops.h"

#include <ATen/ATen.h>

#include <cmath>

#include "server/common/status_macros.h"

namespace gradwire::core {

bool WeightWorkspace::has_columnwise() const {
  for (const Fp8Tensor& w : weights) {
    if (!w.has_columnwise()) return false;
  }
  return true;
}

int64_t WeightWorkspace::bytes() const {
  int64_t total = 0;
  for (const Fp8Tensor& w : weights) total += w.bytes();
  for (const at::Tensor& t : aux) {
    if (t.defined()) total += int64_t(t.nbytes());
  }
  return total;
}

WorkspacePtr PinForBackward(const WorkspacePtr& ws, bool needs_rowwise) {
  if (!ws || needs_rowwise || !ws->for_backward) return ws;
  return ws->for_backward;
}

Fp8Tensor BackwardWeight(const WeightWorkspace& ws, size_t i) {
  Fp8Tensor w = ws.weights.at(i);
  if (!w.dgrad_panels && i < ws.dgrad_panels.size()) w.dgrad_panels = ws.dgrad_panels[i].lock();
  if (!w.dgrad_value_panels && i < ws.dgrad_value_panels.size()) {
    w.dgrad_value_panels = ws.dgrad_value_panels[i].lock();
  }
  return w;
}

bool WorkspaceUsable(const WorkspacePtr& ws, uint64_t weight_version, bool training) {
  return ws && ws->weight_version == weight_version && !ws->weights.empty() &&
         (!training || ws->has_columnwise());
}

absl::StatusOr<Fp8Tensor> CastRows(const Backend& backend, const at::Tensor& x,
                                   const QuantizerConfig& config, CastUsage usage) {
  if (!config.row_groups) return backend.Cast(x, config, usage);
  QuantizerConfig one = config;
  one.row_groups = nullptr;
  one.steps = nullptr;
  std::vector<Fp8Tensor> parts;
  parts.reserve(config.row_groups->size());
  int64_t row = 0;
  for (int64_t rows : *config.row_groups) {
    if (rows <= 0 || row + rows > x.size(0)) break;
    if (config.steps) config.steps->Next(one);
    GW_ASSIGN_OR_RETURN(Fp8Tensor part, backend.Cast(x.narrow(0, row, rows), one, usage));
    if (config.steps) config.steps->Stepped(part.scalars);
    parts.push_back(std::move(part));
    row += rows;
  }
  if (row != x.size(0) || parts.size() != config.row_groups->size()) {
    return absl::InternalError("CastRows: the row groups do not add up to the tensor's rows");
  }
  return StackRows(std::move(parts));
}

absl::StatusOr<Fp8Tensor> LayerNormCastRows(const Backend& backend, const at::Tensor& x,
                                            const LayerNormParams& ln,
                                            const QuantizerConfig& config, CastUsage usage,
                                            bool keep_y, LayerNormOut* ln_out) {
  if (!config.row_groups) return backend.LayerNormCast(x, ln, config, usage, keep_y, ln_out);
  LayerNormOut out = backend.LayerNormForward(x, ln);
  absl::StatusOr<Fp8Tensor> cast = CastRows(backend, out.y, config, usage);
  if (!keep_y) out.y = at::Tensor();
  if (ln_out != nullptr) *ln_out = std::move(out);
  return cast;
}

absl::StatusOr<Fp8Tensor> ActivationCastRows(const Backend& backend, kernels::Activation act,
                                             const at::Tensor& in, int64_t width,
                                             const QuantizerConfig& config, CastUsage usage,
                                             at::Tensor* y) {
  if (!config.row_groups) return backend.ActivationCast(act, in, width, config, usage, y);
  at::Tensor out = backend.ActivationForward(act, in, width);
  absl::StatusOr<Fp8Tensor> cast = CastRows(backend, out, config, usage);
  if (y != nullptr) *y = std::move(out);
  return cast;
}

absl::StatusOr<Fp8Tensor> DActivationCastRows(const Backend& backend, kernels::Activation act,
                                              const at::Tensor& dout, const at::Tensor& in,
                                              int64_t width, const QuantizerConfig& config,
                                              CastUsage usage, at::Tensor* din) {
  if (!config.row_groups) return backend.DActivationCast(act, dout, in, width, config, usage, din);
  at::Tensor out = backend.ActivationBackward(act, dout, in, width);
  absl::StatusOr<Fp8Tensor> cast = CastRows(backend, out, config, usage);
  if (din != nullptr) *din = std::move(out);
  return cast;
}

Fp8Tensor StackRows(std::vector<Fp8Tensor> parts) {
  if (parts.size() == 1) return std::move(parts[0]);
  Fp8Tensor out;
  if (parts.empty()) return out;
  out.format = parts[0].format;
  out.cols = parts[0].cols;
  for (const Fp8Tensor& p : parts) out.rows += p.rows;
  out.groups = std::move(parts);
  // The parts' largest amax (NaN when one is NaN), read when asked: the parts' own reads stay
  // where they are until then.
  std::vector<CastScalars> each;
  for (const Fp8Tensor& p : out.groups) each.push_back(p.scalars);
  out.scalars = CastScalars([each = std::move(each)] {
    float amax = 0.0f;
    for (const CastScalars& p : each) {
      const float a = p.amax();
      if (std::isnan(a) || std::isnan(amax) || a > amax) amax = std::isnan(amax) ? amax : a;
    }
    return std::array<float, 3>{1.0f, 1.0f, amax};
  });
  return out;
}

at::Tensor RowsOf(const at::Tensor& t, int64_t row, int64_t rows) {
  return t.narrow(0, row, rows).clone();
}

at::Tensor FpropRows(const Backend& backend, const Fp8Tensor& x, const Fp8Tensor& w,
                     const at::Tensor& bias, bool bf16, const at::Tensor& into) {
  if (into.defined() && !x.grouped() && !bf16) {
    at::Tensor y = into;
    backend.FpropInto(x, w, bias, y);
    return y;
  }
  if (x.grouped()) {
    at::Tensor y = backend.FpropGroups(x, w, bias);
    return bf16 ? backend.NarrowBf16(y) : y;
  }
  return bf16 ? backend.FpropBf16(x, w, bias) : backend.Fprop(x, w, bias);
}

at::Tensor DgradRows(const Backend& backend, const Fp8Tensor& dy, const Fp8Tensor& w,
                     const at::Tensor& into) {
  if (into.defined() && !dy.grouped()) {
    at::Tensor dx = into;
    backend.DgradInto(dy, w, dx);
    return dx;
  }
  return dy.grouped() ? backend.DgradGroups(dy, w) : backend.Dgrad(dy, w);
}

const Backend& BackendOr(const Backend* backend) {
  return backend != nullptr ? *backend : *MakeReferenceBackend();
}

absl::StatusOr<WorkspaceResult> GetOrBuildWorkspace(const Backend& backend,
                                                    const WorkspacePtr& cached,
                                                    uint64_t weight_version, bool training,
                                                    const std::vector<at::Tensor>& weights,
                                                    const std::vector<QuantizerConfig>& quantizers,
                                                    const std::vector<at::Tensor>& aux) {
  if (WorkspaceUsable(cached, weight_version, training) &&
      cached->weights.size() == weights.size()) {
    return WorkspaceResult{cached, false};
  }
  if (weights.size() != quantizers.size()) {
    return absl::InternalError("GetOrBuildWorkspace: one quantizer per weight");
  }
  auto ws = std::make_shared<WeightWorkspace>();
  ws->weight_version = weight_version;
  for (size_t i = 0; i < weights.size(); ++i) {
    GW_ASSIGN_OR_RETURN(Fp8Tensor w, backend.Cast(weights[i], quantizers[i], {true, training}));
    backend.PrepareWeight(w);  // once per weight version, for every GEMM until the next one
    ws->weights.push_back(std::move(w));
  }
  for (const at::Tensor& t : aux) ws->aux.push_back(t.defined() ? t.clone() : at::Tensor());
  if (training) {
    auto slim = std::make_shared<WeightWorkspace>();
    slim->weight_version = weight_version;
    slim->aux = ws->aux;
    for (const Fp8Tensor& w : ws->weights) {
      Fp8Tensor c = w;
      c.rowwise = at::Tensor();
      c.fprop_panels = nullptr;
      c.dgrad_panels = nullptr;
      c.fprop_value_panels = nullptr;
      c.dgrad_value_panels = nullptr;
      c.rowwise_scale_inv = at::Tensor();
      slim->dgrad_panels.push_back(w.dgrad_panels);
      slim->dgrad_value_panels.push_back(w.dgrad_value_panels);
      slim->weights.push_back(std::move(c));
    }
    ws->for_backward = std::move(slim);
  }
  return WorkspaceResult{std::move(ws), true};
}

at::Tensor As2D(const at::Tensor& t) { return t.contiguous().reshape({-1, t.size(-1)}); }

}  // namespace gradwire::core
