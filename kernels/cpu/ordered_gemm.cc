// The FP8 GEMM's entry point, its packing and its baseline copy (the build's default instruction
// set), dispatching to the widest copy the running CPU supports.
#include "gradwire/kernels/cpu/ordered_gemm.h"

#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "gradwire/kernels/cpu/scratch.h"
#include "ordered_gemm_impl.h"

namespace gradwire::kernels::cpu {

#if defined(GRADWIRE_ORDERED_GEMM_X86)
void OrderedGemmAvx512(const OrderedGemmArgs& g);
void OrderedGemmAvx2(const OrderedGemmArgs& g);
#endif

namespace {

int64_t Panels(int64_t n) { return (n + kPanelWidth - 1) / kPanelWidth; }

// Where column jj (0 .. kPanelWidth - 1) of a panel sits in its row (ordered_gemm.h): columns
// 0-7 in the even words, 8-15 in the odd ones.
constexpr int64_t Slot(int64_t jj) { return jj < 8 ? 2 * jj : 2 * (jj - 8) + 1; }

// The upper half of a float's bits: exact for a value that bf16 holds.
inline uint16_t UpperHalf(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return uint16_t(bits >> 16);
}

// Packs B through `value(j, k)` (B's element at column j of C, depth k), a panel per range of
// the pool; the columns past n are zero.
template <typename Value>
void Pack(int64_t n, int64_t k, uint16_t* out, const Value& value) {
  const int64_t panels = Panels(n);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, k * 16));
  ParallelFor(panels, grain, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      uint16_t* panel = out + q * k * kPanelWidth;
      const int64_t j0 = q * kPanelWidth;
      const int64_t width = std::min<int64_t>(kPanelWidth, n - j0);
      for (int64_t d = 0; d < k; ++d) {
        uint16_t* row = panel + d * kPanelWidth;
        for (int64_t jj = 0; jj < width; ++jj) row[Slot(jj)] = value(j0 + jj, d);
        for (int64_t jj = width; jj < kPanelWidth; ++jj) row[Slot(jj)] = 0;
      }
    }
  });
}

// The FP8 codes' bf16 halves, 256 of them, for a format.
const uint16_t* Bf16Table(Fp8Format format) {
  struct Tables {
    uint16_t t[2][256];
    Tables() {
      for (int f = 0; f < 2; ++f) {
        const float* decoded = DecodeTable(f == 0 ? Fp8Format::kE4M3 : Fp8Format::kE5M2);
        for (int c = 0; c < 256; ++c) t[f][c] = UpperHalf(decoded[c]);
      }
    }
  };
  static const Tables tables;
  return tables.t[format == Fp8Format::kE4M3 ? 0 : 1];
}

// k == 0: every sum is +0, and C gets the epilogue alone.
void EmptySums(const OrderedGemmArgs& g) {
  for (int64_t i = 0; i < g.m; ++i) {
    float* crow = g.c + i * g.ldc;
    const float scale = g.row_scale != nullptr ? g.row_scale[i] : g.scale;
    for (int64_t j = 0; j < g.b.n; ++j) {
      float value = 0.0f * scale;
      if (g.bias != nullptr) value += g.bias[j];
      crow[j] = g.accumulate ? crow[j] + value : value;
    }
  }
}

}  // namespace

size_t PanelBytes(int64_t n, int64_t k) {
  return size_t(Panels(n) * kPanelWidth * k) * sizeof(uint16_t);
}

float PanelValue(const PanelsView& panels, int64_t j, int64_t k) {
  const uint32_t bits = uint32_t(panels.data[(j / kPanelWidth) * panels.k * kPanelWidth +
                                             k * kPanelWidth + Slot(j % kPanelWidth)])
                        << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

void PackPanels(const float* b, int64_t n, int64_t k, int64_t ld, bool n_major, uint16_t* out) {
  // Checked first, in one thread: the packing itself may not throw inside the pool.
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < k; ++d) {
      const float v = n_major ? b[j * ld + d] : b[d * ld + j];
      const uint32_t bits = uint32_t(UpperHalf(v)) << 16;
      float back;
      std::memcpy(&back, &bits, sizeof back);
      if (std::memcmp(&back, &v, sizeof v) != 0) {
        throw std::invalid_argument("PackPanels: B[" + std::to_string(j) + ", " +
                                    std::to_string(d) + "] = " + std::to_string(v) +
                                    " is not exact in bf16");
      }
    }
  }
  if (n_major) {
    Pack(n, k, out, [&](int64_t j, int64_t d) { return UpperHalf(b[j * ld + d]); });
  } else {
    Pack(n, k, out, [&](int64_t j, int64_t d) { return UpperHalf(b[d * ld + j]); });
  }
}

void PackPanelsFromCodes(const uint8_t* codes, Fp8Format format, int64_t n, int64_t k, bool n_major,
                         uint16_t* out) {
  const uint16_t* table = Bf16Table(format);
  if (n_major) {
    Pack(n, k, out, [&](int64_t j, int64_t d) { return table[codes[j * k + d]]; });
  } else {
    Pack(n, k, out, [&](int64_t j, int64_t d) { return table[codes[d * n + j]]; });
  }
}

GemmPanels::GemmPanels(const uint8_t* codes, Fp8Format format, int64_t n, int64_t k, bool n_major)
    : n_(n), k_(k), data_(nullptr) {
  data_ = static_cast<uint16_t*>(AllocateHostBuffer(PanelBytes(n, k)));
  if (data_ == nullptr) throw std::bad_alloc();
  PackPanelsFromCodes(codes, format, n, k, n_major, data_);
}

GemmPanels::~GemmPanels() { FreeHostBuffer(data_); }

bool OrderedGemmCopySupported(OrderedGemmCopy copy) {
  switch (copy) {
    case OrderedGemmCopy::kBaseline:
      return true;
#if defined(GRADWIRE_ORDERED_GEMM_X86)
    case OrderedGemmCopy::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case OrderedGemmCopy::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("fma");
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
  if (g.m <= 0 || g.b.n <= 0) return;
  if (g.b.k <= 0) return EmptySums(g);
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
      // SSE2: 16 xmm registers, two per V8: 4 V8 of sums, a panel row of B and a broadcast.
      Kernel<4, 2>::Run(g);
  }
}

void OrderedGemm(const OrderedGemmArgs& g) { OrderedGemmUsing(OrderedGemmBestCopy(), g); }

}  // namespace gradwire::kernels::cpu
