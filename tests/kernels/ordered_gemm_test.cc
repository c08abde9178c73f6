// The row-invariant GEMM (kernels/cpu/ordered_gemm.h): the reference GEMM's bits on every shape,
// every instruction-set copy and any thread count, and a row's result independent of the rows
// stacked with it (what the dynamic batcher relies on).
#include "gradwire/kernels/cpu/ordered_gemm.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
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
  }

  std::vector<float> Reference(bool with_bias, bool accumulate) const {
    std::vector<float> c = c0;
    Fp8GemmArgs r;
    r.a = {a_codes.data(), fa, sa, false, nullptr};
    r.b = {b_codes.data(), fb, sb, true, nullptr};
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
  std::vector<float> Ordered(OrderedGemmCopy copy, bool with_bias, bool accumulate,
                             int64_t row0 = 0, int64_t rows = -1) const {
    if (rows < 0) rows = m;
    std::vector<float> c(c0.begin() + row0 * n, c0.begin() + (row0 + rows) * n);
    OrderedGemmArgs g;
    g.m = rows;
    g.n = n;
    g.k = k;
    g.a = a.data() + row0 * k;
    g.lda = k;
    g.b = b.data();
    g.ldb = k;
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
  for (OrderedGemmCopy c :
       {OrderedGemmCopy::kBaseline, OrderedGemmCopy::kAvx2, OrderedGemmCopy::kAvx512}) {
    if (cpu::OrderedGemmCopySupported(c)) out.push_back(c);
  }
  return out;
}

TEST(OrderedGemmTest, EveryCopyComputesTheReferenceBitsOnEveryShape) {
  EXPECT_TRUE(cpu::OrderedGemmCopySupported(cpu::OrderedGemmBestCopy()));
  const struct {
    int64_t m, n, k;
  } shapes[] = {{1, 1, 1},       {1, 1, 7},      {1, 17, 8},     {2, 3, 9},     {5, 13, 0},
                {7, 5, 31},      {4, 4, 16},     {9, 11, 63},    {13, 29, 130}, {64, 64, 64},
                {1, 1024, 1024}, {37, 257, 515}, {129, 67, 1031}};
  for (const auto& s : shapes) {
    for (auto [fa, fb] : {std::pair{Fp8Format::kE4M3, Fp8Format::kE4M3},
                          std::pair{Fp8Format::kE5M2, Fp8Format::kE4M3}}) {
      const Problem p(s.m, s.n, s.k, fa, fb);
      for (int variant = 0; variant < 3; ++variant) {
        const bool with_bias = variant == 1, accumulate = variant == 2;
        const std::vector<float> want = p.Reference(with_bias, accumulate);
        for (OrderedGemmCopy copy : Copies()) {
          EXPECT_TRUE(SameBits(p.Ordered(copy, with_bias, accumulate), want))
              << cpu::OrderedGemmCopyName(copy) << " m=" << s.m << " n=" << s.n << " k=" << s.k
              << " variant " << variant;
        }
      }
    }
  }
}

TEST(OrderedGemmTest, ARowsResultDoesNotDependOnTheRowsStackedWithIt) {
  // Groups of 1..300 rows, computed stacked in one call and each alone: the same bits, on one
  // thread and on several (the split over the pool changes with the number of rows).
  std::uniform_int_distribution<int64_t> rows(1, 300);
  std::vector<int64_t> groups;
  int64_t total = 0;
  for (int i = 0; i < 9; ++i) total += groups.emplace_back(i < 3 ? i + 1 : rows(Rng()));
  const Problem p(total, 190, 333, Fp8Format::kE4M3, Fp8Format::kE4M3);
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
    g.n = p.n;
    g.k = p.k;
    g.a = p.a.data();
    g.lda = p.k;
    g.b = p.b.data();
    g.ldb = p.k;
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

}  // namespace
}  // namespace gradwire::kernels
