// The AVX-512 BF16 copy of the FP8 GEMM (compiled with -mavx512f -mavx512bf16; called only on
// CPUs that have them and where it reproduces the baseline's bits, ordered_gemm.cc): vdpbf16ps on
// pairs of k, 24 zmm registers of sums, a main tile of 6 rows x 64 columns.
#include "ordered_gemm_impl.h"

namespace gradwire::kernels::cpu {
void OrderedGemmAvx512Bf16(const OrderedGemmArgs& g) { Kernel<Dot, 24, 6>::Run(g); }
}  // namespace gradwire::kernels::cpu
