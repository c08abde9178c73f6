#include "server/core/fp8_ops.h"

#include <ATen/ATen.h>

#include "server/core/status_macros.h"

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
  if (!w.columnwise_decoded && i < ws.columnwise_decoded.size()) {
    w.columnwise_decoded = ws.columnwise_decoded[i].lock();
  }
  if (!w.rowwise_decoded && i < ws.rowwise_decoded.size()) {
    w.rowwise_decoded = ws.rowwise_decoded[i].lock();
  }
  return w;
}

bool WorkspaceUsable(const WorkspacePtr& ws, uint64_t weight_version, bool training) {
  return ws && ws->weight_version == weight_version && !ws->weights.empty() &&
         (!training || ws->has_columnwise());
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
      c.rowwise_decoded = nullptr;
      c.columnwise_decoded = nullptr;
      slim->columnwise_decoded.push_back(w.columnwise_decoded);
      slim->rowwise_decoded.push_back(w.rowwise_decoded);
      slim->weights.push_back(std::move(c));
    }
    ws->for_backward = std::move(slim);
  }
  return WorkspaceResult{std::move(ws), true};
}

at::Tensor As2D(const at::Tensor& t) { return t.contiguous().reshape({-1, t.size(-1)}); }

}  // namespace gradwire::core
