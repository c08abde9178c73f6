// The row-invariant GEMM's entry point and its baseline copy (the build's default instruction
// set), dispatching to the widest copy the running CPU supports.
#include "gradwire/kernels/cpu/ordered_gemm.h"

#include <stdexcept>

#include "ordered_gemm_impl.h"

namespace gradwire::kernels::cpu {

#if defined(GRADWIRE_ORDERED_GEMM_X86)
void OrderedGemmAvx512(const OrderedGemmArgs& g);
void OrderedGemmAvx2(const OrderedGemmArgs& g);
#endif

bool OrderedGemmCopySupported(OrderedGemmCopy copy) {
  switch (copy) {
    case OrderedGemmCopy::kBaseline:
      return true;
#if defined(GRADWIRE_ORDERED_GEMM_X86)
    case OrderedGemmCopy::kAvx2:
      return __builtin_cpu_supports("avx2");
    case OrderedGemmCopy::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
#endif
    default:
      return false;
  }
}

OrderedGemmCopy OrderedGemmBestCopy() {
  static const OrderedGemmCopy best =
      OrderedGemmCopySupported(OrderedGemmCopy::kAvx512) ? OrderedGemmCopy::kAvx512
      : OrderedGemmCopySupported(OrderedGemmCopy::kAvx2) ? OrderedGemmCopy::kAvx2
                                                         : OrderedGemmCopy::kBaseline;
  return best;
}

const char* OrderedGemmCopyName(OrderedGemmCopy copy) {
  switch (copy) {
    case OrderedGemmCopy::kAvx512:
      return "avx512";
    case OrderedGemmCopy::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

void OrderedGemmUsing(OrderedGemmCopy copy, const OrderedGemmArgs& g) {
  if (!OrderedGemmCopySupported(copy)) {
    throw std::invalid_argument(std::string("OrderedGemm: the ") + OrderedGemmCopyName(copy) +
                                " copy is not available on this build or CPU");
  }
  if (g.m <= 0 || g.n <= 0) return;
  switch (copy) {
#if defined(GRADWIRE_ORDERED_GEMM_X86)
    case OrderedGemmCopy::kAvx512:
      OrderedGemmAvx512(g);
      return;
    case OrderedGemmCopy::kAvx2:
      OrderedGemmAvx2(g);
      return;
#endif
    default:
      Split<2, 2>(g);
  }
}

void OrderedGemm(const OrderedGemmArgs& g) { OrderedGemmUsing(OrderedGemmBestCopy(), g); }

}  // namespace gradwire::kernels::cpu
