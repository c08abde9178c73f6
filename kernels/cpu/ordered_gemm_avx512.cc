// The AVX-512 copy of the row-invariant GEMM (compiled with -mavx512f -mavx512vl: 32 vector
// registers, so larger tiles; called only on CPUs that have it).
#include "ordered_gemm_impl.h"

namespace gradwire::kernels::cpu {
void OrderedGemmAvx512(const OrderedGemmArgs& g) { Split<4, 4>(g); }
}  // namespace gradwire::kernels::cpu
