// The AVX-512 copy of the FP8 GEMM (compiled with -mavx512f -mavx512vl -mfma: 32 vector
// registers; called only on CPUs that have them): 24 ymm registers of sums, a main tile of 6 rows
// x 32 columns.
#include "ordered_gemm_impl.h"

namespace gradwire::kernels::cpu {
void OrderedGemmAvx512(const OrderedGemmArgs& g) { Kernel<24, 6>::Run(g); }
}  // namespace gradwire::kernels::cpu
