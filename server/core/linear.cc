#include "server/core/linear.h"

#include <ATen/ATen.h>

#include "gradwire/kernels/gemm.h"
#include "gradwire/kernels/quantize.h"
#include "server/core/status_macros.h"

namespace gradwire::core {
namespace {

kernels::Fp8Operand Operand(const at::Tensor& codes, const Fp8Tensor& t, bool transposed) {
  return kernels::Fp8Operand{codes.data_ptr<uint8_t>(), t.format, t.scale_inv, transposed};
}

at::Tensor EmptyFloat(int64_t rows, int64_t cols) {
  return at::empty({rows, cols}, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace

bool WorkspaceUsable(const WorkspacePtr& ws, uint64_t weight_version, bool training) {
  return ws && ws->weight_version == weight_version && ws->weight.has_rowwise() &&
         (!training || ws->weight.has_columnwise());
}

absl::StatusOr<LinearFwdResult> LinearForward(const LinearFwdArgs& args) {
  const int64_t m = args.input.size(0), k = args.input.size(1), n = args.weight.size(0);
  if (args.weight.size(1) != k) return absl::InternalError("LinearForward: K mismatch");
  LinearFwdResult result;
  if (WorkspaceUsable(args.workspace, args.weight_version, args.training)) {
    result.workspace = args.workspace;
  } else {
    auto ws = std::make_shared<LinearWorkspace>();
    ws->weight_version = args.weight_version;
    GW_ASSIGN_OR_RETURN(ws->weight, Quantize(args.weight, args.weight_quantizer,
                                             {/*rowwise=*/true, /*columnwise=*/args.training}));
    result.workspace = std::move(ws);
    result.workspace_built = true;
  }
  // Training keeps X^T for wgrad; the rowwise copy only lives for this GEMM.
  GW_ASSIGN_OR_RETURN(Fp8Tensor x, Quantize(args.input, args.input_quantizer,
                                            {/*rowwise=*/true, /*columnwise=*/args.training}));
  result.output = EmptyFloat(m, n);
  const Fp8Tensor& w = result.workspace->weight;
  kernels::Fp8GemmArgs gemm;
  gemm.a = Operand(x.rowwise, x, /*transposed=*/false);
  gemm.b = Operand(w.rowwise, w, /*transposed=*/true);
  gemm.m = m;
  gemm.n = n;
  gemm.k = k;
  gemm.c = result.output.data_ptr<float>();
  gemm.bias = args.bias.defined() ? args.bias.data_ptr<float>() : nullptr;
  kernels::Fp8Gemm(gemm);
  if (args.training) {
    x.rowwise = at::Tensor();
    auto saved = std::make_shared<LinearSaved>();
    saved->input = std::move(x);
    saved->workspace = result.workspace;
    result.saved = std::move(saved);
  }
  return result;
}

absl::StatusOr<LinearBwdResult> LinearBackward(const LinearBwdArgs& args) {
  const LinearSaved& saved = *args.saved;
  const Fp8Tensor& x = saved.input;  // columnwise X^T [K, M]
  const Fp8Tensor& w = saved.workspace->weight;
  const int64_t m = x.rows, k = x.cols, n = w.rows;
  if (args.grad_output.size(0) != m || args.grad_output.size(1) != n) {
    return absl::InternalError("LinearBackward: grad_output does not match the saved forward");
  }
  GW_ASSIGN_OR_RETURN(Fp8Tensor dy, Quantize(args.grad_output, args.grad_quantizer,
                                             {/*rowwise=*/args.compute_grad_input,
                                              /*columnwise=*/true}));
  LinearBwdResult result;
  if (args.compute_grad_input) {  // dX[M,K] = dY[M,N] . W[N,K], W read as its transpose [K,N]
    result.grad_input = EmptyFloat(m, k);
    kernels::Fp8GemmArgs dgrad;
    dgrad.a = Operand(dy.rowwise, dy, false);
    dgrad.b = Operand(w.columnwise, w, true);
    dgrad.m = m;
    dgrad.n = k;
    dgrad.k = n;
    dgrad.c = result.grad_input.data_ptr<float>();
    kernels::Fp8Gemm(dgrad);
  }
  // dW[N,K] += dY^T[N,M] . X[M,K], both read along M.
  kernels::Fp8GemmArgs wgrad;
  wgrad.a = Operand(dy.columnwise, dy, false);
  wgrad.b = Operand(x.columnwise, x, true);
  wgrad.m = n;
  wgrad.n = k;
  wgrad.k = m;
  wgrad.c = args.weight_grad.data_ptr<float>();
  wgrad.accumulate = true;
  kernels::Fp8Gemm(wgrad);
  if (args.bias_grad.defined()) {  // dbias from the unquantized gradient, as the fused cast does
    at::Tensor dbias = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
    kernels::ColumnSums(args.grad_output.data_ptr<float>(), m, n, dbias.data_ptr<float>());
    float* acc = args.bias_grad.data_ptr<float>();
    const float* add = dbias.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) acc[i] += add[i];
  }
  return result;
}

}  // namespace gradwire::core
