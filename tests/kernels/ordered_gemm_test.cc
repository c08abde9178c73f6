// The FP8 GEMM (kernels/cpu/ordered_gemm.h): the reference GEMM's bits on every shape, every
// instruction-set copy and any thread count, a row's result independent of the rows stacked with
// it (what the dynamic batcher relies on), and the reference itself held to the order it documents
// (one rounded add per k, in increasing k) by a sum written out here.
#include "gradwire/kernels/cpu/ordered_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/cast.h"
#include "gradwire/kernels/ref/gemm.h"
#include "random_codes.h"

namespace gradwire::kernels {
namespace {

using cpu::OrderedGemmArgs;
using cpu::OrderedGemmCopy;

using test_data::RandomCodes;
using test_data::Rng;

std::vector<float> Decode(const std::vector<uint8_t>& codes, Fp8Format format) {
  const float* table = DecodeTable(format);
  std::vector<float> out(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) out[i] = table[codes[i]];
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One random problem: A [m, k] and B [n, k] as codes and decoded, a bias, and C's old values.
struct Problem {
  int64_t m, n, k;
  Fp8Format fa, fb;
  float sa = 1, sb = 1;
  std::vector<uint8_t> a_codes, b_codes;
  std::vector<float> a, b, bias, c0;
  std::vector<uint16_t> panels;

  Problem(int64_t m_, int64_t n_, int64_t k_, Fp8Format fa_, Fp8Format fb_)
      : m(m_), n(n_), k(k_), fa(fa_), fb(fb_) {
    a_codes = RandomCodes(m * k, fa, 2.0f, &sa);
    b_codes = RandomCodes(n * k, fb, 0.05f, &sb);
    a = Decode(a_codes, fa);
    b = Decode(b_codes, fb);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    bias.resize(size_t(n));
    for (float& v : bias) v = dist(Rng());
    c0.resize(size_t(m * n));
    for (float& v : c0) v = dist(Rng());
    panels.resize(cpu::PanelBytes(n, k) / sizeof(uint16_t));
    // Poisoned first (0xFFFF is a bf16 NaN): the packing must write every value, the zero
    // padding included.
    std::fill(panels.begin(), panels.end(), uint16_t(0xFFFF));
    cpu::PackPanels(b.data(), n, k, k, /*n_major=*/true, panels.data());
  }

  cpu::PanelsView B() const { return {n, k, panels.data()}; }

  // The documented order written out: +0, then one rounded add per k in increasing k, then
  // [c +] (sum * scale [+ bias]). Independent of kernels/ref and kernels/cpu.
  std::vector<float> Sequential(bool with_bias, bool accumulate) const {
    std::vector<float> c = c0;
    const float scale = sa * sb;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        volatile float sum = 0.0f;  // volatile: each add rounded to fp32, nothing reordered
        for (int64_t d = 0; d < k; ++d) {
          const float product = a[size_t(i * k + d)] * b[size_t(j * k + d)];  // exact
          sum = sum + product;
        }
        float value = sum * scale;
        if (with_bias) value += bias[size_t(j)];
        float& out = c[size_t(i * n + j)];
        out = accumulate ? out + value : value;
      }
    }
    return c;
  }

  std::vector<float> Reference(bool with_bias, bool accumulate) const {
    std::vector<float> c = c0;
    Fp8GemmArgs r;
    r.a = {a_codes.data(), fa, sa, false};
    r.b = {b_codes.data(), fb, sb, true};
    r.m = m;
    r.n = n;
    r.k = k;
    r.c = c.data();
    r.bias = with_bias ? bias.data() : nullptr;
    r.accumulate = accumulate;
    Fp8Gemm(r);
    return c;
  }

  // Rows [row0, row0 + rows) through the ordered kernel on `copy`.
  // `from_codes`: A handed over as its FP8 codes (decoded as the GEMM packs them).
  std::vector<float> Ordered(OrderedGemmCopy copy, bool with_bias, bool accumulate,
                             int64_t row0 = 0, int64_t rows = -1, bool from_codes = false) const {
    if (rows < 0) rows = m;
    std::vector<float> c(c0.begin() + row0 * n, c0.begin() + (row0 + rows) * n);
    OrderedGemmArgs g;
    g.m = rows;
    g.a = a.data() + row0 * k;
    if (from_codes) {
      g.a = nullptr;
      g.a_codes = a_codes.data() + row0 * k;
      g.a_format = fa;
    }
    g.lda = k;
    g.b = B();
    g.scale = sa * sb;
    g.bias = with_bias ? bias.data() : nullptr;
    g.accumulate = accumulate;
    g.c = c.data();
    g.ldc = n;
    cpu::OrderedGemmUsing(copy, g);
    return c;
  }
};

std::vector<OrderedGemmCopy> Copies() {
  std::vector<OrderedGemmCopy> out;
  for (OrderedGemmCopy c : {OrderedGemmCopy::kBaseline, OrderedGemmCopy::kAvx2,
                            OrderedGemmCopy::kAvx512, OrderedGemmCopy::kAvx512Bf16}) {
    if (cpu::OrderedGemmCopySupported(c)) out.push_back(c);
  }
  return out;
}

TEST(OrderedGemmTest, EveryCopyComputesTheReferenceBitsOnEveryShape) {
  EXPECT_TRUE(cpu::OrderedGemmCopySupported(cpu::OrderedGemmBestCopy()));
  const struct {
    int64_t m, n, k;
  } shapes[] = {{1, 1, 1},       {1, 1, 7},      {1, 17, 8},      {2, 3, 9},      {5, 13, 0},
                {7, 5, 31},      {4, 4, 16},     {9, 11, 63},     {13, 29, 130},  {64, 64, 64},
                {1, 1024, 1024}, {37, 257, 515}, {129, 67, 1031}, {6, 16, 5},     {12, 32, 3},
                {11, 97, 41},    {3, 200, 17},   {23, 16, 2},     {30, 100, 513}, {25, 70, 514},
                {1, 400, 4}};
  for (const auto& s : shapes) {
    for (auto [fa, fb] : {std::pair{Fp8Format::kE4M3, Fp8Format::kE4M3},
                          std::pair{Fp8Format::kE5M2, Fp8Format::kE4M3}}) {
      const Problem p(s.m, s.n, s.k, fa, fb);
      for (int variant = 0; variant < 3; ++variant) {
        const bool with_bias = variant == 1, accumulate = variant == 2;
        const std::vector<float> want = p.Reference(with_bias, accumulate);
        EXPECT_TRUE(SameBits(p.Sequential(with_bias, accumulate), want))
            << "the reference, m=" << s.m << " n=" << s.n << " k=" << s.k;
        for (OrderedGemmCopy copy : Copies()) {
          EXPECT_TRUE(SameBits(p.Ordered(copy, with_bias, accumulate), want))
              << cpu::OrderedGemmCopyName(copy) << " m=" << s.m << " n=" << s.n << " k=" << s.k
              << " variant " << variant;
          EXPECT_TRUE(SameBits(p.Ordered(copy, with_bias, accumulate, 0, -1, true), want))
              << cpu::OrderedGemmCopyName(copy) << " from codes, m=" << s.m << " n=" << s.n
              << " k=" << s.k << " variant " << variant;
        }
      }
    }
  }
}

// Block-scaled codes for A (a_block_scale): each code decoded and times its block's power of two
// as the GEMM packs it gives the bits of A's dequantized values handed over as floats, for every
// copy, for blocks one row high (activations, gradients) and square ones (weights), partial edge
// blocks, and a depth the GEMM walks in blocks of k.
TEST(OrderedGemmTest, BlockScaledCodesGiveTheBitsOfTheirDequantizedValues) {
  struct Case {
    int64_t m, n, k;
    BlockShape block;
  };
  const int threads_before = cpu::Threads();
  for (const Case& c : {Case{37, 45, 300, {1, 32}}, Case{70, 33, 1030, {1, 128}},
                        Case{130, 20, 260, {128, 128}}, Case{9, 17, 61, {3, 5}}}) {
    Problem p(c.m, c.n, c.k, Fp8Format::kE4M3, Fp8Format::kE4M3);
    const int64_t grid_rows = BlockGridRows(c.m, c.block), grid_cols = BlockGridCols(c.k, c.block);
    std::vector<float> grid(size_t(grid_rows * grid_cols));
    std::uniform_int_distribution<int> exponent(-12, 12);
    for (float& s : grid) s = std::ldexp(1.0f, exponent(Rng()));
    std::vector<float> values(size_t(c.m * c.k));
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t d = 0; d < c.k; ++d) {
        values[size_t(i * c.k + d)] =
            p.a[size_t(i * c.k + d)] *
            grid[size_t((i / c.block.rows) * grid_cols + d / c.block.cols)];
      }
    }
    auto run = [&](OrderedGemmCopy copy, bool blocked) {
      std::vector<float> out(size_t(c.m * c.n));
      OrderedGemmArgs g;
      g.m = c.m;
      g.lda = c.k;
      if (blocked) {
        g.a_codes = p.a_codes.data();
        g.a_format = p.fa;
        g.a_block_scale = grid.data();
        g.a_block = c.block;
        g.a_block_ld = grid_cols;
      } else {
        g.a = values.data();
      }
      g.b = p.B();
      g.c = out.data();
      g.ldc = c.n;
      cpu::OrderedGemmUsing(copy, g);
      return out;
    };
    const std::vector<float> want = run(OrderedGemmCopy::kBaseline, false);
    for (OrderedGemmCopy copy : Copies()) {
      for (int threads : {1, 3}) {
        cpu::SetThreads(threads);
        EXPECT_TRUE(SameBits(run(copy, true), want))
            << cpu::OrderedGemmCopyName(copy) << " " << c.m << "x" << c.n << "x" << c.k << " block "
            << c.block.rows << "x" << c.block.cols << " threads " << threads;
      }
    }
  }
  cpu::SetThreads(threads_before);
}

TEST(OrderedGemmTest, ARowsResultDoesNotDependOnTheRowsStackedWithIt) {
  // Groups of 1..300 rows, computed stacked in one call and each alone: the same bits, on one
  // thread and on several (the split over the pool changes with the number of rows).
  std::uniform_int_distribution<int64_t> rows(1, 300);
  std::vector<int64_t> groups;
  int64_t total = 0;
  for (int i = 0; i < 9; ++i) total += groups.emplace_back(i < 3 ? i + 1 : rows(Rng()));
  const Problem p(total, 190, 777, Fp8Format::kE4M3, Fp8Format::kE4M3);  // k in blocks
  const int threads_before = cpu::Threads();
  for (int threads : {1, 2, 3}) {
    cpu::SetThreads(threads);
    const std::vector<float> stacked = p.Ordered(cpu::OrderedGemmBestCopy(), true, false);
    int64_t row0 = 0;
    for (int64_t g : groups) {
      const std::vector<float> alone = p.Ordered(cpu::OrderedGemmBestCopy(), true, false, row0, g);
      const std::vector<float> part(stacked.begin() + row0 * p.n,
                                    stacked.begin() + (row0 + g) * p.n);
      EXPECT_TRUE(SameBits(alone, part))
          << g << " rows at row " << row0 << ", " << threads << " threads";
      row0 += g;
    }
  }
  cpu::SetThreads(threads_before);
}

TEST(OrderedGemmTest, RowScalesGiveEachRowGroupTheBitsOfItsOwnScale) {
  // Rows that came from different casts: each group's scale through row_scale, in one call,
  // against each group alone with that scale as the scalar (what the batcher's fused GEMM does).
  const std::vector<int64_t> groups = {1, 5, 17, 2, 40};
  int64_t total = 0;
  for (int64_t g : groups) total += g;
  const Problem p(total, 77, 129, Fp8Format::kE4M3, Fp8Format::kE4M3);
  std::uniform_real_distribution<float> scale(0.01f, 8.0f);
  std::vector<float> group_scale, row_scale;
  for (int64_t g : groups) {
    group_scale.push_back(scale(Rng()));
    row_scale.insert(row_scale.end(), size_t(g), group_scale.back());
  }
  for (OrderedGemmCopy copy : Copies()) {
    std::vector<float> stacked(size_t(total * p.n));
    OrderedGemmArgs g;
    g.m = total;
    g.a = p.a.data();
    g.lda = p.k;
    g.b = p.B();
    g.scale = 12345.0f;  // ignored: row_scale wins
    g.row_scale = row_scale.data();
    g.bias = p.bias.data();
    g.c = stacked.data();
    g.ldc = p.n;
    cpu::OrderedGemmUsing(copy, g);
    int64_t row0 = 0;
    for (size_t i = 0; i < groups.size(); ++i) {
      std::vector<float> alone(size_t(groups[i] * p.n));
      g.m = groups[i];
      g.a = p.a.data() + row0 * p.k;
      g.scale = group_scale[i];
      g.row_scale = nullptr;
      g.c = alone.data();
      cpu::OrderedGemmUsing(copy, g);
      const std::vector<float> part(stacked.begin() + row0 * p.n,
                                    stacked.begin() + (row0 + groups[i]) * p.n);
      EXPECT_TRUE(SameBits(alone, part)) << cpu::OrderedGemmCopyName(copy) << " group " << i;
      row0 += groups[i];
    }
  }
}

TEST(OrderedGemmTest, TheOrderIsOneRoundedAddPerKInIncreasingK) {
  // 16 * 16 = 2^8, then two products of 2^-16: each is half an ulp of 256, so added one at a
  // time each rounds away (to even), while any other grouping adds 2^-15 first and keeps it. A
  // kernel that reorders, pairs or splits k fails here whatever the reference does.
  const float e4m3_16 = 16.0f, e4m3_tiny = std::ldexp(1.0f, -8);  // both exact in E4M3
  for (int64_t n : {int64_t(1), int64_t(17), int64_t(40)}) {
    std::vector<float> a = {e4m3_16, e4m3_tiny, e4m3_tiny};
    std::vector<float> b;
    for (int64_t j = 0; j < n; ++j) b.insert(b.end(), {e4m3_16, e4m3_tiny, e4m3_tiny});
    std::vector<uint16_t> panels(cpu::PanelBytes(n, 3) / sizeof(uint16_t));
    cpu::PackPanels(b.data(), n, 3, 3, true, panels.data());
    for (OrderedGemmCopy copy : Copies()) {
      std::vector<float> c(size_t(n), -1.0f);
      OrderedGemmArgs g;
      g.m = 1;
      g.a = a.data();
      g.lda = 3;
      g.b = {n, 3, panels.data()};
      g.c = c.data();
      g.ldc = n;
      cpu::OrderedGemmUsing(copy, g);
      for (int64_t j = 0; j < n; ++j) {
        EXPECT_EQ(c[size_t(j)], 256.0f) << cpu::OrderedGemmCopyName(copy) << " column " << j;
      }
    }
  }
  // The reference, on the same values as codes.
  std::vector<uint8_t> codes(3);
  const float values[3] = {e4m3_16, e4m3_tiny, e4m3_tiny};
  QuantizeFp8(values, 1, 3, 1.0f, Fp8Format::kE4M3, codes.data(), nullptr, nullptr);
  float c = -1.0f;
  Fp8GemmArgs r;
  r.a = {codes.data(), Fp8Format::kE4M3, 1.0f, false};
  r.b = {codes.data(), Fp8Format::kE4M3, 1.0f, true};
  r.m = r.n = 1;
  r.k = 3;
  r.c = &c;
  Fp8Gemm(r);
  EXPECT_EQ(c, 256.0f);
}

TEST(OrderedGemmTest, TheChosenCopyRunsAndEveryCopyIsNamed) {
  // The widest supported copy is the default; SetOrderedGemmCopy picks another (--cpu-isa) and
  // OrderedGemm then gives the same bits on it; an unsupported one is refused naming the best.
  EXPECT_EQ(cpu::OrderedGemmActiveCopy(), cpu::OrderedGemmBestCopy());
  for (OrderedGemmCopy c : {OrderedGemmCopy::kAvx512Bf16, OrderedGemmCopy::kAvx512,
                            OrderedGemmCopy::kAvx2, OrderedGemmCopy::kBaseline}) {
    EXPECT_EQ(cpu::OrderedGemmCopyByName(cpu::OrderedGemmCopyName(c)), c);
    if (cpu::OrderedGemmCopySupported(c)) {
      EXPECT_GE(int(cpu::OrderedGemmBestCopy()), int(c))
          << "the best copy is the widest supported one, " << cpu::OrderedGemmCopyName(c)
          << " or wider";
    }
  }
  EXPECT_FALSE(cpu::OrderedGemmCopyByName("avx1024").has_value());
  const Problem p(19, 70, 301, Fp8Format::kE5M2, Fp8Format::kE4M3);
  const std::vector<float> want = p.Reference(true, false);
  for (OrderedGemmCopy copy : Copies()) {
    cpu::SetOrderedGemmCopy(copy);
    EXPECT_EQ(cpu::OrderedGemmActiveCopy(), copy);
    std::vector<float> c(size_t(p.m * p.n));
    OrderedGemmArgs g;
    g.m = p.m;
    g.a_codes = p.a_codes.data();
    g.a_format = p.fa;
    g.lda = p.k;
    g.b = p.B();
    g.scale = p.sa * p.sb;
    g.bias = p.bias.data();
    g.c = c.data();
    g.ldc = p.n;
    cpu::OrderedGemm(g);
    EXPECT_TRUE(SameBits(c, want)) << cpu::OrderedGemmCopyName(copy);
  }
  cpu::SetOrderedGemmCopy(std::nullopt);
  EXPECT_EQ(cpu::OrderedGemmActiveCopy(), cpu::OrderedGemmBestCopy());
  for (OrderedGemmCopy c :
       {OrderedGemmCopy::kAvx512Bf16, OrderedGemmCopy::kAvx512, OrderedGemmCopy::kAvx2}) {
    if (cpu::OrderedGemmCopySupported(c)) continue;
    try {
      cpu::SetOrderedGemmCopy(c);
      ADD_FAILURE() << cpu::OrderedGemmCopyName(c) << " was chosen on a CPU without it";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(cpu::OrderedGemmCopyName(cpu::OrderedGemmBestCopy())),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(cpu::OrderedGemmActiveCopy(), cpu::OrderedGemmBestCopy());
  }
}

TEST(OrderedGemmTest, TheBf16CopyRunsAFloatANotExactInBf16AsTheAvx512CopyDoes) {
  if (!cpu::OrderedGemmCopySupported(OrderedGemmCopy::kAvx512Bf16)) {
    GTEST_SKIP() << "this CPU has no AVX-512 BF16 copy (best: "
                 << cpu::OrderedGemmCopyName(cpu::OrderedGemmBestCopy()) << ")";
  }
  // A's values with 11 significant bits: a bf16 A would drop the low ones, so the copy must not
  // read A as bf16 here.
  Problem p(13, 40, 37, Fp8Format::kE4M3, Fp8Format::kE4M3);
  for (float& v : p.a) v = v * (1.0f + std::ldexp(1.0f, -10));
  std::vector<float> got(size_t(p.m * p.n)), want(got.size());
  OrderedGemmArgs g;
  g.m = p.m;
  g.a = p.a.data();
  g.lda = p.k;
  g.b = p.B();
  g.ldc = p.n;
  g.c = want.data();
  cpu::OrderedGemmUsing(OrderedGemmCopy::kAvx512, g);
  g.c = got.data();
  cpu::OrderedGemmUsing(OrderedGemmCopy::kAvx512Bf16, g);
  EXPECT_TRUE(SameBits(got, want));
}

TEST(OrderedGemmTest, PackingFromCodesInEitherLayoutGivesThePanelsOfTheDecodedValues) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{1, 1}, {17, 5}, {16, 16}, {33, 7}, {5, 40}}) {
    float scale_inv = 1;
    const std::vector<uint8_t> codes = RandomCodes(n * k, Fp8Format::kE5M2, 1.0f, &scale_inv);
    const std::vector<float> values = Decode(codes, Fp8Format::kE5M2);  // [n, k]
    std::vector<uint8_t> transposed(codes.size());                      // [k, n]
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < k; ++d) transposed[size_t(d * n + j)] = codes[size_t(j * k + d)];
    }
    std::vector<uint16_t> want(cpu::PanelBytes(n, k) / sizeof(uint16_t), uint16_t(0xFFFF));
    cpu::PackPanels(values.data(), n, k, k, true, want.data());
    // Every panel value is B's value or, past n (and past an odd k), zero; and each sits where
    // the kernels read it: a panel is (k + 1) / 2 row pairs of 16 words, column c's word of pair
    // t holding depth 2t in its upper half (the higher address) and 2t + 1 in its lower half.
    const cpu::PanelsView view{n, k, want.data()};
    const int64_t panel_size = (k + 1) / 2 * 32;
    EXPECT_EQ(want.size(), size_t((n + 15) / 16 * panel_size));
    for (int64_t j = 0; j < (n + 15) / 16 * 16; ++j) {
      for (int64_t d = 0; d < (k + 1) / 2 * 2; ++d) {
        const float expect = j < n && d < k ? values[size_t(j * k + d)] : 0.0f;
        if (d < k) EXPECT_EQ(cpu::PanelValue(view, j, d), expect) << j << "," << d;
        const int64_t c = j % 16, slot = (d / 2) * 32 + 2 * c + (d % 2 == 0 ? 1 : 0);
        const uint16_t word = want[size_t((j / 16) * panel_size + slot)];
        uint32_t bits;
        std::memcpy(&bits, &expect, sizeof bits);
        EXPECT_EQ(word, uint16_t(bits >> 16)) << j << "," << d;
        EXPECT_EQ(bits & 0xFFFFu, 0u) << "not exact in bf16: " << expect;
      }
    }
    for (bool n_major : {true, false}) {
      std::vector<uint16_t> got(want.size(), uint16_t(0xFFFF));
      cpu::PackPanelsFromCodes(n_major ? codes.data() : transposed.data(), Fp8Format::kE5M2, n, k,
                               n_major, got.data());
      EXPECT_EQ(got, want) << n << "x" << k << (n_major ? " n-major" : " k-major");
      const cpu::GemmPanels owned(n_major ? codes.data() : transposed.data(), Fp8Format::kE5M2, n,
                                  k, n_major);
      EXPECT_EQ(std::memcmp(owned.view().data, want.data(), want.size() * sizeof(uint16_t)), 0);
    }
  }
}

// Packing B from block-scaled codes (each code decoded and times its block's power of two) gives
// the panels of the dequantized values, for power-of-two blocks (shifts) and others (division),
// partial edge blocks included.
TEST(OrderedGemmTest, PackingFromBlockCodesGivesThePanelsOfTheDequantizedValues) {
  for (const BlockShape block : {BlockShape{1, 32}, BlockShape{128, 128}, BlockShape{3, 5}}) {
    const int64_t n = 150, k = 301;
    float unused = 1;
    const std::vector<uint8_t> codes = RandomCodes(n * k, Fp8Format::kE4M3, 1.0f, &unused);
    const int64_t grid_cols = BlockGridCols(k, block);
    std::vector<float> grid(size_t(BlockGridRows(n, block) * grid_cols));
    std::uniform_int_distribution<int> exponent(-20, 20);
    for (float& s : grid) s = std::ldexp(1.0f, exponent(Rng()));
    std::vector<float> values = Decode(codes, Fp8Format::kE4M3);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < k; ++d) {
        values[size_t(j * k + d)] *= grid[size_t((j / block.rows) * grid_cols + d / block.cols)];
      }
    }
    const size_t words = cpu::PanelBytes(n, k) / sizeof(uint16_t);
    std::vector<uint16_t> want(words, 0xFFFF), got(words, 0xFFFF);
    cpu::PackPanels(values.data(), n, k, k, /*n_major=*/true, want.data());
    cpu::PackPanelsFromBlockCodes(codes.data(), Fp8Format::kE4M3, grid.data(), block, grid_cols, n,
                                  k, got.data());
    EXPECT_EQ(got, want) << "block " << block.rows << "x" << block.cols;
  }
}

TEST(OrderedGemmTest, EveryFp8ValueIsExactInBf16AndPackingRefusesOneThatIsNot) {
  // The panels keep bf16: exact for all 2 x 256 codes (subnormals and the largest values too).
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    std::vector<float> all(256);
    for (int c = 0; c < 256; ++c) all[size_t(c)] = DecodeTable(format)[c];
    std::vector<float> finite;
    for (float v : all) {
      if (std::isfinite(v)) finite.push_back(v);
    }
    const int64_t n = int64_t(finite.size());
    std::vector<uint16_t> panels(cpu::PanelBytes(n, 1) / sizeof(uint16_t));
    cpu::PackPanels(finite.data(), n, 1, 1, true, panels.data());
    for (int64_t j = 0; j < n; ++j) {
      const float got = cpu::PanelValue({n, 1, panels.data()}, j, 0);
      EXPECT_EQ(std::memcmp(&got, &finite[size_t(j)], sizeof got), 0) << finite[size_t(j)];
    }
  }
  const float inexact[2] = {1.0f, 1.0f + std::ldexp(1.0f, -10)};  // 11 significant bits
  std::vector<uint16_t> panels(cpu::PanelBytes(2, 1) / sizeof(uint16_t));
  try {
    cpu::PackPanels(inexact, 2, 1, 1, true, panels.data());
    ADD_FAILURE() << "an inexact value was packed";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("B[1, 0]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gradwire::kernels
