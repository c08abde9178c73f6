// The FP8 cast's element loops written for AVX-512F (16 lanes, mask registers, vpmovdb), compiled
// for it alone and run only where the CPU has it (cast_isa.h). Each lane computes EncodeOne of
// cast.cc with the same integer and float operations, so the codes are that loop's bit for bit:
// the float products and sums below are the same IEEE operations (no contraction: the library is
// built with -ffp-contract=off) and everything else is exact integer work.
#include <immintrin.h>

#include "cast_isa.h"

namespace gradwire::kernels::cpu::isa {
namespace {

template <Fp8Format Fmt, int M, int Bias, int MinExp, uint32_t MaxBits, uint32_t MaxCode>
struct Format {
  static constexpr Fp8Format kFormat = Fmt;
  static constexpr int kM = M, kBias = Bias, kMinExp = MinExp;
  static constexpr uint32_t kMaxBits = MaxBits, kMaxCode = MaxCode;
};
using E4M3 = Format<Fp8Format::kE4M3, 3, 7, -6, 0x43E00000u, 0x7Eu>;
using E5M2 = Format<Fp8Format::kE5M2, 2, 15, -14, 0x47600000u, 0x7Bu>;

// The codes of 16 scaled values v (cast.cc's EncodeOne, lane by lane), one per 32-bit lane.
template <typename F>
inline __m512i Encode16(__m512 v) {
  constexpr int kShift = 23 - F::kM;
  const __m512i u = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, kShift), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((1 << (kShift - 1)) - 1)), lsb);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, kShift),
                                          _mm512_set1_epi32((127 - F::kBias) << F::kM));
  constexpr float kSubScale = float(1u << (F::kM - F::kMinExp));
  const __m512 scaled = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(kSubScale));
  const __m512i sub =
      _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(scaled, _mm512_set1_ps(8388608.0f))),
                       _mm512_set1_epi32(0x4B000000));
  constexpr uint32_t kMinNormalBits = uint32_t(F::kMinExp + 127) << 23;
  const __mmask16 is_normal = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(int(kMinNormalBits)));
  const __mmask16 saturate = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(int(F::kMaxBits)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
  __m512i code = _mm512_mask_blend_epi32(is_normal, sub, normal);
  code = _mm512_mask_blend_epi32(saturate, code, _mm512_set1_epi32(int(F::kMaxCode)));
  code = _mm512_mask_blend_epi32(nan, code, _mm512_set1_epi32(0x7F));
  return _mm512_or_si512(code, sign);
}

// Every lane's code is below 256 with the sign at bit 7: vpmovdb keeps it exactly.
inline void Store16(uint8_t* out, __m512i codes) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(codes));
}

inline __mmask16 Tail(int64_t n) { return __mmask16((1u << n) - 1u); }

template <typename F>
void EncodeT(const float* x, int64_t n, float scale, uint8_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i c = Encode16<F>(_mm512_mul_ps(_mm512_loadu_ps(x + i), s));
    Store16(out + i, c);
  }
  if (i < n) {
    const __mmask16 k = Tail(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), s);
    _mm512_mask_cvtepi32_storeu_epi8(out + i, k, Encode16<F>(v));
  }
}

// The largest |x| bits as AbsMaxBits orders them (an unsigned max of bits & 0x7FFFFFFF).
template <typename F>
uint32_t EncodeAmaxT(const float* x, int64_t n, float scale, uint8_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i m = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(xv), abs_mask));
    Store16(out + i, Encode16<F>(_mm512_mul_ps(xv, s)));
  }
  if (i < n) {
    const __mmask16 k = Tail(n - i);
    const __m512 xv = _mm512_maskz_loadu_ps(k, x + i);  // zeros past n: below every |x|
    m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(xv), abs_mask));
    _mm512_mask_cvtepi32_storeu_epi8(out + i, k, Encode16<F>(_mm512_mul_ps(xv, s)));
  }
  return uint32_t(_mm512_reduce_max_epu32(m));
}

template <typename F>
void EncodeScaledT(const float* x, const float* scale, int64_t n, uint8_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(scale + i));
    Store16(out + i, Encode16<F>(v));
  }
  if (i < n) {
    const __mmask16 k = Tail(n - i);
    const __m512 v =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), _mm512_maskz_loadu_ps(k, scale + i));
    _mm512_mask_cvtepi32_storeu_epi8(out + i, k, Encode16<F>(v));
  }
}

// The largest finite |x| of x[0, n) as bits, and colmax[i] raised to each x[i]'s; *all raised to
// the largest |x| bits of them all.
inline uint32_t BlockStats(const float* x, int64_t n, uint32_t* colmax, __m512i* all) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i inf = _mm512_set1_epi32(0x7F800000);
  __m512i fin = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : Tail(n - i);
    const __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi32(k, x + i), abs_mask);
    *all = _mm512_max_epu32(*all, a);
    const __m512i f = _mm512_maskz_mov_epi32(_mm512_cmplt_epu32_mask(a, inf), a);
    fin = _mm512_max_epu32(fin, f);
    if (colmax != nullptr) {
      const __m512i c = _mm512_maskz_loadu_epi32(k, colmax + i);
      _mm512_mask_storeu_epi32(colmax + i, k, _mm512_max_epu32(c, f));
    }
  }
  return uint32_t(_mm512_reduce_max_epu32(fin));
}

template <typename F>
uint32_t RowBlocksT(const float* x, int64_t n, int64_t length, uint8_t* out, float* scale_inv,
                    uint32_t* colmax, uint32_t all) {
  __m512i any = _mm512_set1_epi32(int(all));
  for (int64_t b0 = 0, j = 0; b0 < n; b0 += length, ++j) {
    const int64_t m = n - b0 < length ? n - b0 : length;
    const uint32_t fin = BlockStats(x + b0, m, colmax ? colmax + b0 : nullptr, &any);
    if (out == nullptr) continue;
    const int e = ScaleExponentOfBits(fin, F::kFormat);
    scale_inv[j] = Pow2(e);
    EncodeT<F>(x + b0, m, Pow2(-e), out + b0);  // the block again, now from L1
  }
  return uint32_t(_mm512_reduce_max_epu32(any));
}

template <typename F>
void TileScaledT(const float* x, int64_t ld, int64_t rows, int64_t n, const float* scale,
                 uint8_t* out, int64_t out_ld) {
  for (int64_t r = 0; r < rows; ++r) EncodeScaledT<F>(x + r * ld, scale, n, out + r * out_ld);
}

void Encode(const float* x, int64_t n, float scale, Fp8Format format, uint8_t* out) {
  format == Fp8Format::kE4M3 ? EncodeT<E4M3>(x, n, scale, out) : EncodeT<E5M2>(x, n, scale, out);
}
uint32_t EncodeAmax(const float* x, int64_t n, float scale, Fp8Format format, uint8_t* out) {
  return format == Fp8Format::kE4M3 ? EncodeAmaxT<E4M3>(x, n, scale, out)
                                    : EncodeAmaxT<E5M2>(x, n, scale, out);
}
void EncodeScaled(const float* x, const float* scale, int64_t n, Fp8Format format, uint8_t* out) {
  format == Fp8Format::kE4M3 ? EncodeScaledT<E4M3>(x, scale, n, out)
                             : EncodeScaledT<E5M2>(x, scale, n, out);
}

uint32_t RowBlocks(const float* x, int64_t n, int64_t length, Fp8Format format, uint8_t* out,
                   float* scale_inv, uint32_t* colmax, uint32_t all) {
  return format == Fp8Format::kE4M3 ? RowBlocksT<E4M3>(x, n, length, out, scale_inv, colmax, all)
                                    : RowBlocksT<E5M2>(x, n, length, out, scale_inv, colmax, all);
}
void TileScaled(const float* x, int64_t ld, int64_t rows, int64_t n, const float* scale,
                Fp8Format format, uint8_t* out, int64_t out_ld) {
  format == Fp8Format::kE4M3 ? TileScaledT<E4M3>(x, ld, rows, n, scale, out, out_ld)
                             : TileScaledT<E5M2>(x, ld, rows, n, scale, out, out_ld);
}

}  // namespace

const CastLoops* Avx512CastLoops() {
  static const CastLoops loops{&Encode, &EncodeAmax, &EncodeScaled, &RowBlocks, &TileScaled};
  return &loops;
}

}  // namespace gradwire::kernels::cpu::isa
