// The FP8 cast's element loops as written for one instruction set (cast_avx512.cc), behind
// function pointers: kernels/cpu/cast.cc runs them where the CPU has that set and the process has
// not chosen a narrower one (SetOrderedGemmCopy, the server's --cpu-isa), and its own
// compiler-vectorised loops elsewhere. Every copy gives the same codes bit for bit.
#pragma once

#include <cstdint>

#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/block_scaling.h"

namespace gradwire::kernels::cpu::isa {

struct CastLoops {
  // out[i] = Encode(x[i] * scale).
  void (*encode)(const float* x, int64_t n, float scale, Fp8Format format, uint8_t* out);
  // The same; returns the largest bits of |x[i]| (bits & 0x7FFFFFFF, unsigned max).
  uint32_t (*encode_amax)(const float* x, int64_t n, float scale, Fp8Format format, uint8_t* out);
  // out[i] = Encode(x[i] * scale[i]).
  void (*encode_scaled)(const float* x, const float* scale, int64_t n, Fp8Format format,
                        uint8_t* out);
  // One row of the line-blocked cast (QuantizeLineBlocks): for each block of `length` values
  // along the row (the last may be shorter), its scale exponent from its largest finite |x|
  // (ScaleExponentOfBits), 2^e into scale_inv[block] and the codes of x * 2^-e into out, when
  // out is not null; colmax[i] raised to the bits of x[i]'s finite |x| when colmax is not null.
  // Returns max(all, the largest bits of |x[i]|).
  uint32_t (*row_blocks)(const float* x, int64_t n, int64_t length, Fp8Format format, uint8_t* out,
                         float* scale_inv, uint32_t* colmax, uint32_t all);
  // rows x n values at x (row stride ld), each row's n values times scale[0..n), encoded into
  // out (row stride out_ld).
  void (*tile_scaled)(const float* x, int64_t ld, int64_t rows, int64_t n, const float* scale,
                      Fp8Format format, uint8_t* out, int64_t out_ld);
};

// The helpers below are compiled into each copy's file with that file's instruction set: an
// unnamed namespace keeps each file's own, so the linker never hands baseline code a copy built
// for AVX-512.
namespace {

// kernels::BlockScaleExponent of a finite amax >= 0 given as its bits, without libm: with
// amax = (1 + fa) 2^ea and Fp8Max = (1 + fm) 2^em (both normal), amax <= Fp8Max 2^e first holds
// at e = ea - em when fa <= fm, else one above; a subnormal amax lies far under the clamp.
inline int ScaleExponentOfBits(uint32_t amax_bits, Fp8Format format) {
  if (amax_bits == 0) return 0;
  if (amax_bits >= 0x7F800000u) return kBlockScaleExponentMax;
  if (amax_bits < 0x00800000u) return kBlockScaleExponentMin;
  const uint32_t max_bits = __builtin_bit_cast(uint32_t, Fp8Max(format));
  const int e = int(amax_bits >> 23) - int(max_bits >> 23) +
                int((amax_bits & 0x7FFFFFu) > (max_bits & 0x7FFFFFu));
  return e < kBlockScaleExponentMin   ? kBlockScaleExponentMin
         : e > kBlockScaleExponentMax ? kBlockScaleExponentMax
                                      : e;
}

// 2^e as a float, exact for e in [kBlockScaleExponentMin, kBlockScaleExponentMax] (normal).
inline float Pow2(int e) { return __builtin_bit_cast(float, uint32_t(127 + e) << 23); }

}  // namespace

// The AVX-512F loops (x86-64 builds only).
const CastLoops* Avx512CastLoops();

}  // namespace gradwire::kernels::cpu::isa
