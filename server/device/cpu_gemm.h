// Which GEMM the CPU backend's three products (forward, input gradient, weight gradient) run on.
//
//   kOrdered  the default: the FP8 GEMM (kernels/cpu/ordered_gemm.h), register-tiled, each
//             element computed with the reference backend's arithmetic. The CPU backend then
//             gives the reference backend's bits for every product, and a row's result never
//             depends on which rows share the call, which is what makes dynamic batching exact.
//             A weight's packed panels are built once per weight version (PrepareWeight).
//   kBlas     the process's BLAS (kernels/cpu/blas.h) on the decoded operands, for comparison
//             (--cpu-gemm blas): a row's result may depend on the other rows in the call (BLAS
//             picks its kernels and blocking by shape), so batches run one GEMM per request.
//
// gradwire-server sets this from --cpu-gemm at start.
#pragma once

#include <string>

namespace gradwire::device {

enum class CpuGemm { kBlas, kOrdered };

void SetCpuGemm(CpuGemm gemm);
CpuGemm GetCpuGemm();

// The FP8 GEMM's micro-kernel copy by name (--cpu-isa): "auto" for the widest this CPU runs, or
// a name of kernels/cpu/ordered_gemm.h. Returns why it cannot be used (empty: done; nothing is
// changed then).
std::string SetCpuIsa(const std::string& name);

}  // namespace gradwire::device
