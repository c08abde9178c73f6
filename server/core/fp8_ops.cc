#include "server/core/fp8_ops.h"

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>

#include "gradwire/kernels/ref/cast.h"
#include "gradwire/kernels/ref/gemm.h"
#include "server/core/status_macros.h"

namespace gradwire::core {
namespace {

kernels::Fp8Operand Operand(const at::Tensor& codes, const Fp8Tensor& t, bool transposed) {
  kernels::Fp8Operand op{codes.data_ptr<uint8_t>(), t.format, t.scale_inv, transposed, nullptr};
  const auto& decoded = codes.is_same(t.rowwise) ? t.rowwise_decoded : t.columnwise_decoded;
  if (decoded) op.decoded = decoded->data();
  return op;
}

// The codes of `codes` decoded to floats in storage order (no scale).
std::shared_ptr<const std::vector<float>> Decoded(const at::Tensor& codes,
                                                  kernels::Fp8Format format) {
  if (!codes.defined()) return nullptr;
  const float* table = kernels::DecodeTable(format);
  const uint8_t* data = codes.data_ptr<uint8_t>();
  auto out = std::make_shared<std::vector<float>>(static_cast<size_t>(codes.numel()));
  for (int64_t i = 0; i < codes.numel(); ++i) (*out)[size_t(i)] = table[data[i]];
  return out;
}

at::Tensor EmptyFloat(int64_t rows, int64_t cols) {
  return at::empty({rows, cols}, at::TensorOptions().dtype(at::kFloat));
}

std::atomic<double> g_gemm_flops{0};
std::atomic<double> g_gemm_seconds{0};

void Add(std::atomic<double>& counter, double value) {
  double seen = counter.load(std::memory_order_relaxed);
  while (!counter.compare_exchange_weak(seen, seen + value, std::memory_order_relaxed)) {
  }
}

// Runs one GEMM and counts its work.
void RunGemm(const kernels::Fp8GemmArgs& gemm) {
  const auto start = std::chrono::steady_clock::now();
  kernels::Fp8Gemm(gemm);
  Add(g_gemm_seconds,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  Add(g_gemm_flops, 2.0 * double(gemm.m) * double(gemm.n) * double(gemm.k));
}

}  // namespace

GemmCounters GemmTotals() { return {g_gemm_flops.load(), g_gemm_seconds.load()}; }

void CountGemm(double flops, double seconds) {
  Add(g_gemm_flops, flops);
  Add(g_gemm_seconds, seconds);
}

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

void AttachDecodedCopies(Fp8Tensor& w) {
  w.rowwise_decoded = Decoded(w.rowwise, w.format);
  w.columnwise_decoded = Decoded(w.columnwise, w.format);
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

at::Tensor Fp8Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias) {
  at::Tensor y = EmptyFloat(x.rows, w.rows);
  kernels::Fp8GemmArgs gemm;
  gemm.a = Operand(x.rowwise, x, /*transposed=*/false);
  gemm.b = Operand(w.rowwise, w, /*transposed=*/true);
  gemm.m = x.rows;
  gemm.n = w.rows;
  gemm.k = x.cols;
  gemm.c = y.data_ptr<float>();
  gemm.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  RunGemm(gemm);
  return y;
}

at::Tensor Fp8Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) {
  at::Tensor dx = EmptyFloat(dy.rows, w.cols);
  kernels::Fp8GemmArgs gemm;
  gemm.a = Operand(dy.rowwise, dy, false);
  gemm.b = Operand(w.columnwise, w, true);  // W^T stored [K, N]: contiguous along N
  gemm.m = dy.rows;
  gemm.n = w.cols;
  gemm.k = dy.cols;
  gemm.c = dx.data_ptr<float>();
  RunGemm(gemm);
  return dx;
}

void Fp8Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc, bool accumulate) {
  kernels::Fp8GemmArgs gemm;
  gemm.a = Operand(dy.columnwise, dy, false);  // dY^T stored [N, M]
  gemm.b = Operand(x.columnwise, x, true);     // X^T stored [K, M]
  gemm.m = dy.cols;
  gemm.n = x.cols;
  gemm.k = dy.rows;
  gemm.c = acc.data_ptr<float>();
  gemm.accumulate = accumulate;
  RunGemm(gemm);
}

void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) {
  const int64_t rows = g.size(0), cols = g.size(1);
  std::vector<float> sums(static_cast<size_t>(cols));
  kernels::ColumnSums(g.data_ptr<float>(), rows, cols, sums.data());
  float* out = acc.data_ptr<float>();
  for (int64_t c = 0; c < cols; ++c) out[c] += sums[size_t(c)];
}

at::Tensor As2D(const at::Tensor& t) { return t.contiguous().reshape({-1, t.size(-1)}); }

}  // namespace gradwire::core
