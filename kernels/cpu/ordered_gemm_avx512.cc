// The AVX-512F copy of the FP8 GEMM (compiled with -mavx512f -mfma; called only on CPUs that have
// them): 16-lane zmm multiply-adds, 24 of the 32 registers holding sums, a main tile of 6 rows x 64
// columns.
#include "ordered_gemm_impl.h"

namespace gradwire::kernels::cpu {
void OrderedGemmAvx512(const OrderedGemmArgs& g) { Kernel<Fma<Lanes16>, 24, 6>::Run(g); }
}  // namespace gradwire::kernels::cpu
