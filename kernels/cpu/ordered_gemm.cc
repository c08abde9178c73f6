// The FP8 GEMM's entry point, its packing and its baseline copy (the build's default instruction
// set), dispatching to the widest copy the running CPU supports.
#include "gradwire/kernels/cpu/ordered_gemm.h"

#include <atomic>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "gradwire/kernels/cpu/scratch.h"
#include "ordered_gemm_impl.h"

namespace gradwire::kernels::cpu {

#if defined(GRADWIRE_ORDERED_GEMM_X86)
void OrderedGemmAvx512Bf16(const OrderedGemmArgs& g);
void OrderedGemmAvx512(const OrderedGemmArgs& g);
void OrderedGemmAvx2(const OrderedGemmArgs& g);
#endif

namespace {

int64_t Panels(int64_t n) { return (n + kPanelWidth - 1) / kPanelWidth; }

// bf16 values in one panel: its pairs of k (an odd k's last pair padded), 2 x kPanelWidth each.
int64_t PanelSize(int64_t k) { return Pairs(k) * 2 * kPanelWidth; }

// Where column jj (0 .. kPanelWidth - 1) at depth d sits in its panel (ordered_gemm.h): in the
// word of pair d / 2 for column jj, the upper half (the higher address) for the even d.
constexpr int64_t Slot(int64_t jj, int64_t d) {
  return (d / 2) * 2 * kPanelWidth + 2 * jj + (d % 2 == 0 ? 1 : 0);
}

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
      uint16_t* panel = out + q * PanelSize(k);
      const int64_t j0 = q * kPanelWidth;
      const int64_t width = std::min<int64_t>(kPanelWidth, n - j0);
      for (int64_t t = 0; t < Pairs(k); ++t) {
        uint16_t* pair = panel + t * 2 * kPanelWidth;
        for (int64_t jj = 0; jj < width; ++jj) {
          pair[2 * jj + 1] = value(j0 + jj, 2 * t);
          pair[2 * jj] = 2 * t + 1 < k ? value(j0 + jj, 2 * t + 1) : uint16_t(0);
        }
        for (int64_t jj = 2 * width; jj < 2 * kPanelWidth; ++jj) pair[jj] = 0;
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
  return size_t(Panels(n) * PanelSize(k)) * sizeof(uint16_t);
}

float PanelValue(const PanelsView& panels, int64_t j, int64_t k) {
  const uint32_t bits =
      uint32_t(panels.data[(j / kPanelWidth) * PanelSize(panels.k) + Slot(j % kPanelWidth, k)])
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

void PackPanelsFromBlockCodes(const uint8_t* codes, Fp8Format format, const float* grid,
                              BlockShape block, int64_t grid_ld, int64_t n, int64_t k,
                              uint16_t* out) {
  const float* table = DecodeTable(format);
  auto pow2 = [](int64_t v) { return v > 0 && (v & (v - 1)) == 0; };
  if (pow2(block.rows) && pow2(block.cols)) {  // every recipe's blocks: shifts, no division
    const int rs = __builtin_ctzll(uint64_t(block.rows)),
              cs = __builtin_ctzll(uint64_t(block.cols));
    Pack(n, k, out, [&](int64_t j, int64_t d) {
      return UpperHalf(table[codes[j * k + d]] * grid[(j >> rs) * grid_ld + (d >> cs)]);
    });
  } else {
    Pack(n, k, out, [&](int64_t j, int64_t d) {
      return UpperHalf(table[codes[j * k + d]] * grid[(j / block.rows) * grid_ld + d / block.cols]);
    });
  }
}

GemmPanels::GemmPanels(const uint8_t* codes, Fp8Format format, int64_t n, int64_t k, bool n_major)
    : n_(n), k_(k), data_(nullptr) {
  data_ = static_cast<uint16_t*>(AllocateHostBuffer(PanelBytes(n, k)));
  if (data_ == nullptr) throw std::bad_alloc();
  PackPanelsFromCodes(codes, format, n, k, n_major, data_);
}

GemmPanels::~GemmPanels() { FreeHostBuffer(data_); }

namespace {

// The baseline copy. SSE2: 16 xmm registers, two per V8: 4 V8 of sums, a panel row of B and a
// broadcast.
void OrderedGemmBaseline(const OrderedGemmArgs& g) { Kernel<Fma<Lanes8>, 4, 2>::Run(g); }

#if defined(GRADWIRE_ORDERED_GEMM_X86)
// Whether the AVX-512 BF16 copy gives the baseline copy's bits on this CPU: a product of
// E5M2 x E4M3 values over the codes' whole finite range, deep and odd enough to hold every kind
// of step (its sums span 2^-25 .. 2^24, and the pair order decides about one step in two
// hundred, so an instruction that added a pair the other way round fails here).
bool Bf16CopyReproducesTheReference() {
  constexpr int64_t m = 7, n = 37, k = 301;
  std::vector<uint8_t> a(size_t(m * k)), b(size_t(n * k));
  uint32_t state = 0x2545F491u;
  auto next = [&state]() {
    state = state * 1664525u + 1013904223u;
    return uint8_t(state >> 24);
  };
  for (uint8_t& c : a) {
    do c = next();
    while ((c & 0x7C) == 0x7C);  // E5M2 inf and NaN
  }
  for (uint8_t& c : b) {
    do c = next();
    while ((c & 0x7F) == 0x7F);  // E4M3 NaN
  }
  std::vector<uint16_t> panels(PanelBytes(n, k) / sizeof(uint16_t));
  PackPanelsFromCodes(b.data(), Fp8Format::kE4M3, n, k, true, panels.data());
  std::vector<float> want(size_t(m * n)), got(size_t(m * n));
  OrderedGemmArgs g;
  g.m = m;
  g.a_codes = a.data();
  g.a_format = Fp8Format::kE5M2;
  g.lda = k;
  g.b = {n, k, panels.data()};
  g.ldc = n;
  g.c = want.data();
  OrderedGemmBaseline(g);
  g.c = got.data();
  OrderedGemmAvx512Bf16(g);
  return std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0;
}
#endif

// Whether every value of A [m, k] (row stride lda) is exact in bf16, as a decoded FP8 value is.
bool ExactInBf16(const float* a, int64_t m, int64_t k, int64_t lda) {
  for (int64_t i = 0; i < m; ++i) {
    const float* row = a + i * lda;
    uint32_t low = 0;
    for (int64_t d = 0; d < k; ++d) low |= __builtin_bit_cast(uint32_t, row[d]) & 0xFFFFu;
    if (low != 0) return false;
  }
  return true;
}

// The copy chosen by SetOrderedGemmCopy (int(copy)), or -1: the best one.
std::atomic<int> g_chosen{-1};

}  // namespace

bool OrderedGemmCopySupported(OrderedGemmCopy copy) {
  switch (copy) {
    case OrderedGemmCopy::kBaseline:
      return true;
#if defined(GRADWIRE_ORDERED_GEMM_X86)
    case OrderedGemmCopy::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case OrderedGemmCopy::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    case OrderedGemmCopy::kAvx512Bf16: {
      static const bool ok = __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bf16") &&
                             Bf16CopyReproducesTheReference();
      return ok;
    }
#endif
    default:
      return false;
  }
}

OrderedGemmCopy OrderedGemmBestCopy() {
  static const OrderedGemmCopy best = [] {
    for (OrderedGemmCopy c :
         {OrderedGemmCopy::kAvx512Bf16, OrderedGemmCopy::kAvx512, OrderedGemmCopy::kAvx2}) {
      if (OrderedGemmCopySupported(c)) return c;
    }
    return OrderedGemmCopy::kBaseline;
  }();
  return best;
}

OrderedGemmCopy OrderedGemmActiveCopy() {
  const int chosen = g_chosen.load(std::memory_order_relaxed);
  return chosen < 0 ? OrderedGemmBestCopy() : OrderedGemmCopy(chosen);
}

void SetOrderedGemmCopy(std::optional<OrderedGemmCopy> copy) {
  if (copy && !OrderedGemmCopySupported(*copy)) {
    throw std::invalid_argument(std::string("the ") + OrderedGemmCopyName(*copy) +
                                " copy of the FP8 GEMM is not available on this build or CPU "
                                "(this CPU's best: " +
                                OrderedGemmCopyName(OrderedGemmBestCopy()) + ")");
  }
  g_chosen.store(copy ? int(*copy) : -1, std::memory_order_relaxed);
}

const char* OrderedGemmCopyName(OrderedGemmCopy copy) {
  switch (copy) {
    case OrderedGemmCopy::kAvx512Bf16:
      return "avx512bf16";
    case OrderedGemmCopy::kAvx512:
      return "avx512";
    case OrderedGemmCopy::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

std::optional<OrderedGemmCopy> OrderedGemmCopyByName(const std::string& name) {
  for (OrderedGemmCopy c : {OrderedGemmCopy::kBaseline, OrderedGemmCopy::kAvx2,
                            OrderedGemmCopy::kAvx512, OrderedGemmCopy::kAvx512Bf16}) {
    if (name == OrderedGemmCopyName(c)) return c;
  }
  return std::nullopt;
}

void OrderedGemmUsing(OrderedGemmCopy copy, const OrderedGemmArgs& g) {
  if (!OrderedGemmCopySupported(copy)) {
    throw std::invalid_argument(std::string("OrderedGemm: the ") + OrderedGemmCopyName(copy) +
                                " copy is not available on this build or CPU");
  }
  if (g.m <= 0 || g.b.n <= 0) return;
  if (g.b.k <= 0) return EmptySums(g);
  // The dot-product copy reads A as bf16: a float A that is not exact there (not decoded FP8
  // values) runs on the widest copy that multiplies in fp32 instead.
  if (copy == OrderedGemmCopy::kAvx512Bf16 && g.a_codes == nullptr &&
      !ExactInBf16(g.a, g.m, g.b.k, g.lda)) {
    copy = OrderedGemmCopy::kAvx512;
  }
  switch (copy) {
#if defined(GRADWIRE_ORDERED_GEMM_X86)
    case OrderedGemmCopy::kAvx512Bf16:
      OrderedGemmAvx512Bf16(g);
      return;
    case OrderedGemmCopy::kAvx512:
      OrderedGemmAvx512(g);
      return;
    case OrderedGemmCopy::kAvx2:
      OrderedGemmAvx2(g);
      return;
#endif
    default:
      OrderedGemmBaseline(g);
  }
}

void OrderedGemm(const OrderedGemmArgs& g) { OrderedGemmUsing(OrderedGemmActiveCopy(), g); }

}  // namespace gradwire::kernels::cpu
