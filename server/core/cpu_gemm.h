// Which GEMM the CPU backend's forward and input-gradient products run on.
//
//   kBlas     the process's BLAS (kernels/cpu/blas.h): the fastest on large products; a row's
//             result may depend on the other rows in the call (BLAS picks its kernels and
//             blocking by shape).
//   kOrdered  the row-invariant GEMM (kernels/cpu/ordered_gemm.h): every element computed with
//             the reference backend's arithmetic, so Fprop and Dgrad give the reference backend's
//             bits, and a row's result never depends on which rows share the call. What dynamic
//             batching needs to be exact; slower than BLAS on large products.
//
// Weight gradients stay on BLAS either way (a weight gradient sums over all rows).
// gradwire-server sets this from --cpu-gemm at start.
#pragma once

namespace gradwire::core {

enum class CpuGemm { kBlas, kOrdered };

void SetCpuGemm(CpuGemm gemm);
CpuGemm GetCpuGemm();

}  // namespace gradwire::core
