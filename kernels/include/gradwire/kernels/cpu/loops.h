// The CPU backend's element-wise and reduction loops over host memory: threaded on the backend's
// pool (parallel.h) and vectorised for the CPU found at load time. They replace generic tensor
// ops in the hot path: each is one pass over its data, allocates nothing, and gives the same bits
// as the reference loop it stands for (kernels/ref), which the tests check.
//
// All pointers are host memory, non-owning; n, rows and cols may be 0.
#pragma once

#include <cstdint>

#include "gradwire/kernels/fp8.h"

namespace gradwire::kernels::cpu {

// The AbsMax of values whose |x| bit patterns (bits & 0x7FFFFFFF) have this largest pattern:
// patterns of non-negative floats sort as the floats do, and every NaN's sorts above +inf's, so an
// integer max over them finds the float max and any NaN in one vectorisable pass.
inline float AbsMaxFromBits(uint32_t max_bits) {
  return max_bits > 0x7F800000u ? __builtin_nanf("") : __builtin_bit_cast(float, max_bits);
}

// max |x_i|; NaN when any element is NaN (+inf when one is infinite and none is NaN); 0 for
// n == 0. As kernels::Amax.
float AbsMax(const float* x, int64_t n);

// out = a + b element-wise (out may be a or b); returns AbsMax(out), so a caller learns in the
// same pass whether the sum stayed finite.
float AddAbsMax(const float* a, const float* b, float* out, int64_t n);

// acc[c] += (sum over r of x[r, c]) for x [rows, cols]: each column summed in row order in fp32,
// then added, exactly as kernels::ColumnSums followed by an add. Threaded over columns.
void AddColumnSums(const float* x, int64_t rows, int64_t cols, float* acc);

// out[i] = the value of FP8 code codes[i] (no scale), as kernels::DecodeTable(format)[codes[i]].
void DecodeCodes(const uint8_t* codes, int64_t n, Fp8Format format, float* out);

// out[r, c] = row[c] for every r < rows: a bias broadcast as the first term of a GEMM's sum.
void FillRows(const float* row, int64_t rows, int64_t cols, float* out);

}  // namespace gradwire::kernels::cpu
