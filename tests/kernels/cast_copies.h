// The CPU cast's element loops come in copies (kernels/cpu/cast_isa.h): the compiler-vectorised
// ones, and the AVX-512F ones where the CPU has it. The process's GEMM copy picks between them
// (SetOrderedGemmCopy, the server's --cpu-isa); a test of the casts runs its body on each.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "gradwire/kernels/cpu/ordered_gemm.h"

namespace gradwire::kernels {

// Runs body() once per cast copy this CPU has, then goes back to the copy that ran before, even
// when body() throws.
template <typename Body>
void ForEachCastCopy(Body&& body) {
  struct Restore {
    cpu::OrderedGemmCopy before = cpu::OrderedGemmActiveCopy();
    ~Restore() { cpu::SetOrderedGemmCopy(before); }
  } restore;
  for (cpu::OrderedGemmCopy copy :
       {cpu::OrderedGemmCopy::kBaseline, cpu::OrderedGemmCopy::kAvx512}) {
    if (!cpu::OrderedGemmCopySupported(copy)) continue;
    cpu::SetOrderedGemmCopy(copy);
    SCOPED_TRACE(std::string("cast loops of the ") + cpu::OrderedGemmCopyName(copy) + " copy");
    body();
  }
}

}  // namespace gradwire::kernels
