// The AVX2 copy of the row-invariant GEMM (compiled with -mavx2; called only on CPUs that have it).
#include "ordered_gemm_impl.h"

namespace gradwire::kernels::cpu {
void OrderedGemmAvx2(const OrderedGemmArgs& g) { Split<2, 4>(g); }
}  // namespace gradwire::kernels::cpu
