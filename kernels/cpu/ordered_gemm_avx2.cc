// The AVX2 copy of the FP8 GEMM (compiled with -mavx2 -mfma; called only on CPUs that have both):
// 8-lane ymm multiply-adds, 12 registers of sums, a main tile of 6 rows x 16 columns.
#include "ordered_gemm_impl.h"

namespace gradwire::kernels::cpu {
void OrderedGemmAvx2(const OrderedGemmArgs& g) { Kernel<Fma<Lanes8>, 12, 6>::Run(g); }
}  // namespace gradwire::kernels::cpu
