#include "server/core/linear.h"

#include <ATen/ATen.h>

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
  if (args.compute_grad_input) result.grad_input = b.Dgrad(dy, w);
  at::Tensor weight_grad = args.weight_grad;
  b.WgradAccumulate(dy, x, weight_grad);
  if (args.bias_grad.defined()) {  // dbias from the unquantized gradient, as the fused cast does
    at::Tensor bias_grad = args.bias_grad;
    b.AccumulateBiasGrad(args.grad_output, bias_grad);
  }
  return result;
}

}  // namespace gradwire::core
