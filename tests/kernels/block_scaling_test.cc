// Block-scaled FP8 casts of the reference backend (BLOCK and MXFP8, docs/block-scaling.md)
// against an independent float64 model written here from the definitions: the format's values
// from its bit layout, the scale exponent by search, the codes by nearest value.
#include "gradwire/kernels/ref/block_scaling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cast_copies.h"
#include "fp8_model.h"
#include "gradwire/kernels/cpu/cast.h"
#include "gradwire/kernels/cpu/ordered_gemm.h"
#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/cast.h"
#include "gradwire/kernels/ref/gemm.h"

namespace gradwire::kernels {
namespace {

double ModelMax(const FormatModel& f) {
  double max = 0;
  for (double v : ModelValues(f)) {
    if (std::isfinite(v)) max = std::max(max, v);
  }
  return max;
}

// The smallest integer e with amax <= max * 2^e, found by search; 0 for amax == 0; clamped.
int ModelExponent(const FormatModel& f, double amax) {
  if (amax == 0) return 0;
  const double max = ModelMax(f);
  int e = -400;
  while (!(amax <= std::ldexp(max, e)) && e < 400) ++e;
  return std::clamp(e, -50, 50);
}

struct ModelCast {
  std::vector<int> codes;           // [rows, cols]; -1 where the code must be a NaN
  std::vector<int> exponents;       // [grid rows, grid cols]
  std::vector<double> dequantized;  // [rows, cols]
};

ModelCast ModelQuantize(const FormatModel& f, const std::vector<float>& x, int64_t rows,
                        int64_t cols, int64_t block_rows, int64_t block_cols) {
  const int64_t grid_rows = (rows + block_rows - 1) / block_rows;
  const int64_t grid_cols = (cols + block_cols - 1) / block_cols;
  ModelCast m;
  m.codes.assign(size_t(rows * cols), 0);
  m.dequantized.assign(size_t(rows * cols), 0);
  m.exponents.assign(size_t(grid_rows * grid_cols), 0);
  // Each block's amax over its finite elements, gathered element by element.
  std::vector<double> amax(m.exponents.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double v = x[size_t(r * cols + c)];
      double& a = amax[size_t((r / block_rows) * grid_cols + c / block_cols)];
      if (std::isfinite(v)) a = std::max(a, std::fabs(v));
    }
  }
  for (size_t b = 0; b < amax.size(); ++b) m.exponents[b] = ModelExponent(f, amax[b]);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int e = m.exponents[size_t((r / block_rows) * grid_cols + c / block_cols)];
      const double v = x[size_t(r * cols + c)];
      const int code = ModelEncode(f, std::ldexp(v, -e));  // exact in float64
      m.codes[size_t(r * cols + c)] = code;
      m.dequantized[size_t(r * cols + c)] = code < 0 ? NAN : std::ldexp(ModelDecode(f, code), e);
    }
  }
  return m;
}

std::mt19937& Rng() {
  thread_local std::mt19937 rng(std::random_device{}());
  return rng;
}

// Random values whose magnitude changes from block to block (2^-72 .. 2^72, past both ends of
// the scale range), with some blocks zero and some elements NaN, +-inf, float subnormals or
// outliers.
std::vector<float> RandomBlocked(int64_t rows, int64_t cols, int64_t block_rows,
                                 int64_t block_cols) {
  std::uniform_int_distribution<int> block_exponent(-72, 72);
  std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
  std::uniform_int_distribution<int> special(0, 199);
  const int64_t grid_rows = (rows + block_rows - 1) / block_rows;
  const int64_t grid_cols = (cols + block_cols - 1) / block_cols;
  std::vector<int> exponents(size_t(grid_rows * grid_cols));
  std::vector<bool> zero_block(exponents.size());
  for (size_t i = 0; i < exponents.size(); ++i) {
    exponents[i] = block_exponent(Rng());
    zero_block[i] = special(Rng()) < 12;
  }
  std::vector<float> x(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const size_t b = size_t((r / block_rows) * grid_cols + c / block_cols);
      float v = std::ldexp(mantissa(Rng()), exponents[b]);
      switch (special(Rng())) {
        case 0:
          v = NAN;
          break;
        case 1:
          v = INFINITY;
          break;
        case 2:
          v = -INFINITY;
          break;
        case 3:
          v = 3e6f;
          break;
        case 4:
          v = -FLT_MAX;
          break;
        case 5:
          v = std::ldexp(1.0f, -140);
          break;  // a float subnormal
        case 6:
          v = -FLT_MIN;
          break;
        default:
          break;
      }
      x[size_t(r * cols + c)] = zero_block[b] ? 0.0f : v;
    }
  }
  return x;
}

struct Case {
  FormatModel format;
  int64_t block_rows, block_cols;
  int64_t rows, cols;
};

std::string CaseName(const Case& c) {
  return std::string(Fp8FormatName(c.format.format)) + "_block" + std::to_string(c.block_rows) +
         "x" + std::to_string(c.block_cols) + "_" + std::to_string(c.rows) + "x" +
         std::to_string(c.cols);
}

class BlockQuantizeTest : public ::testing::TestWithParam<Case> {};

TEST_P(BlockQuantizeTest, CodesScalesAndTransposeMatchFloat64Model) {
  const Case p = GetParam();
  const BlockShape block{p.block_rows, p.block_cols};
  const int64_t grid_rows = BlockGridRows(p.rows, block), grid_cols = BlockGridCols(p.cols, block);
  ASSERT_EQ(grid_rows, (p.rows + p.block_rows - 1) / p.block_rows);
  ASSERT_EQ(grid_cols, (p.cols + p.block_cols - 1) / p.block_cols);
  for (int trial = 0; trial < 3; ++trial) {
    const std::vector<float> x = RandomBlocked(p.rows, p.cols, p.block_rows, p.block_cols);
    const ModelCast m = ModelQuantize(p.format, x, p.rows, p.cols, p.block_rows, p.block_cols);
    // Poisoned outputs: every element must be written.
    std::vector<uint8_t> out(x.size(), 0x5A), out_t(x.size(), 0xA5);
    std::vector<float> scale(size_t(grid_rows * grid_cols), -3.0f);
    std::vector<float> scale_t(scale.size(), -5.0f);
    QuantizeBlocks(x.data(), p.rows, p.cols, block, p.format.format, out.data(), scale.data(),
                   out_t.data(), scale_t.data());
    for (int64_t i = 0; i < grid_rows; ++i) {
      for (int64_t j = 0; j < grid_cols; ++j) {
        const double want = std::ldexp(1.0, m.exponents[size_t(i * grid_cols + j)]);
        ASSERT_EQ(double(scale[size_t(i * grid_cols + j)]), want) << "block " << i << "," << j;
        ASSERT_EQ(double(scale_t[size_t(j * grid_rows + i)]), want) << "block " << i << "," << j;
      }
    }
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t c = 0; c < p.cols; ++c) {
        const int want = m.codes[size_t(r * p.cols + c)];
        const uint8_t got = out[size_t(r * p.cols + c)];
        const uint8_t got_t = out_t[size_t(c * p.rows + r)];
        if (want < 0) {
          ASSERT_TRUE(IsNanCode(p.format, got)) << r << "," << c;
        } else {
          ASSERT_EQ(int(got), want) << r << "," << c << " value " << x[size_t(r * p.cols + c)];
        }
        ASSERT_EQ(got_t, got) << r << "," << c;
      }
    }
    // Dequantized: exact, and the transposed copy read with its own block shape is the same.
    std::vector<float> deq(x.size(), NAN), deq_t(x.size(), NAN);
    DequantizeBlocks(out.data(), p.rows, p.cols, block, scale.data(), p.format.format, deq.data());
    DequantizeBlocks(out_t.data(), p.cols, p.rows, BlockShape{p.block_cols, p.block_rows},
                     scale_t.data(), p.format.format, deq_t.data());
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t c = 0; c < p.cols; ++c) {
        const double want = m.dequantized[size_t(r * p.cols + c)];
        const float got = deq[size_t(r * p.cols + c)];
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(got)) << r << "," << c;
        } else {
          ASSERT_EQ(double(got), want) << r << "," << c;
        }
        const float got_t = deq_t[size_t(c * p.rows + r)];
        ASSERT_TRUE(got_t == got || (std::isnan(got) && std::isnan(got_t))) << r << "," << c;
      }
    }
  }
}

// Either output may be skipped; the other is unchanged by it.
TEST_P(BlockQuantizeTest, EachOrientationAlone) {
  const Case p = GetParam();
  const BlockShape block{p.block_rows, p.block_cols};
  const std::vector<float> x = RandomBlocked(p.rows, p.cols, p.block_rows, p.block_cols);
  const size_t grid = size_t(BlockGridRows(p.rows, block) * BlockGridCols(p.cols, block));
  std::vector<uint8_t> both(x.size()), both_t(x.size()), alone(x.size()), alone_t(x.size());
  std::vector<float> s(grid), s_t(grid), s_alone(grid), s_alone_t(grid);
  QuantizeBlocks(x.data(), p.rows, p.cols, block, p.format.format, both.data(), s.data(),
                 both_t.data(), s_t.data());
  QuantizeBlocks(x.data(), p.rows, p.cols, block, p.format.format, alone.data(), s_alone.data(),
                 nullptr, nullptr);
  QuantizeBlocks(x.data(), p.rows, p.cols, block, p.format.format, nullptr, nullptr, alone_t.data(),
                 s_alone_t.data());
  EXPECT_EQ(alone, both);
  EXPECT_EQ(alone_t, both_t);
  EXPECT_EQ(s_alone, s);
  EXPECT_EQ(s_alone_t, s_t);
}

// The CPU backend's threaded loops (kernels/cpu/cast.h) give the reference's bytes: codes (NaN
// codes included), both scale grids, the transposed copy, each orientation alone, and the
// dequantized values; on one thread and on three (more workers than blocks in some shapes).
TEST_P(BlockQuantizeTest, CpuLoopsAreTheReferenceBits) {
  const Case p = GetParam();
  const BlockShape block{p.block_rows, p.block_cols};
  const size_t grid = size_t(BlockGridRows(p.rows, block) * BlockGridCols(p.cols, block));
  const int threads_before = cpu::Threads();
  for (int threads : {1, 3}) {
    cpu::SetThreads(threads);
    const std::vector<float> x = RandomBlocked(p.rows, p.cols, p.block_rows, p.block_cols);
    std::vector<uint8_t> ref(x.size()), ref_t(x.size());
    std::vector<float> s(grid), s_t(grid);
    QuantizeBlocks(x.data(), p.rows, p.cols, block, p.format.format, ref.data(), s.data(),
                   ref_t.data(), s_t.data());
    std::vector<uint8_t> got(x.size(), 0x5A), got_t(x.size(), 0xA5), alone_t(x.size(), 0x33);
    std::vector<float> g(grid, -3.0f), g_t(grid, -5.0f), alone_s_t(grid, -7.0f);
    cpu::QuantizeBlocks(x.data(), p.rows, p.cols, block, p.format.format, got.data(), g.data(),
                        got_t.data(), g_t.data());
    cpu::QuantizeBlocks(x.data(), p.rows, p.cols, block, p.format.format, nullptr, nullptr,
                        alone_t.data(), alone_s_t.data());
    ASSERT_EQ(got, ref) << threads << " threads";
    ASSERT_EQ(got_t, ref_t) << threads << " threads";
    ASSERT_EQ(alone_t, ref_t) << threads << " threads";
    ASSERT_EQ(g, s);
    ASSERT_EQ(g_t, s_t);
    ASSERT_EQ(alone_s_t, s_t);
    std::vector<float> deq(x.size()), deq_cpu(x.size(), -1.0f);
    DequantizeBlocks(ref.data(), p.rows, p.cols, block, s.data(), p.format.format, deq.data());
    cpu::DequantizeBlocks(ref.data(), p.rows, p.cols, block, s.data(), p.format.format,
                          deq_cpu.data());
    ASSERT_EQ(0, std::memcmp(deq.data(), deq_cpu.data(), deq.size() * sizeof(float)));
  }
  cpu::SetThreads(threads_before);
}

// The one-pass cast of activations and gradients (cpu::QuantizeLineBlocks): its rowwise copy is
// the reference's with blocks 1 x L, its columnwise copy the reference's transposed copy with
// blocks L x 1, each alone or both, and its amax the reference's Amax; on one thread and on
// three, on every cast copy. Values drawn blocked along rows and along columns.
TEST_P(BlockQuantizeTest, LineBlocksAreTheReferenceBits) {
  const Case p = GetParam();
  if (p.block_rows != 1) GTEST_SKIP() << "a line block is 1 x L";
  const int64_t length = p.block_cols;
  const BlockShape row_block{1, length}, col_block{length, 1};
  const size_t grid = size_t(BlockGridRows(p.rows, row_block) * BlockGridCols(p.cols, row_block));
  const size_t grid_t = size_t(BlockGridRows(p.rows, col_block) * BlockGridCols(p.cols, col_block));
  const int threads_before = cpu::Threads();
  for (int threads : {1, 3}) {
    cpu::SetThreads(threads);
    for (bool along_rows : {true, false}) {
      const std::vector<float> x = along_rows ? RandomBlocked(p.rows, p.cols, 1, length)
                                              : RandomBlocked(p.rows, p.cols, length, 1);
      std::vector<uint8_t> ref(x.size()), ref_t(x.size());
      std::vector<float> s(grid), s_t(grid_t);
      QuantizeBlocks(x.data(), p.rows, p.cols, row_block, p.format.format, ref.data(), s.data(),
                     nullptr, nullptr);
      QuantizeBlocks(x.data(), p.rows, p.cols, col_block, p.format.format, nullptr, nullptr,
                     ref_t.data(), s_t.data());
      const float ref_amax = Amax(x.data(), int64_t(x.size()));
      ForEachCastCopy([&] {
        for (int mask = 1; mask < 4; ++mask) {  // rowwise, columnwise, both
          SCOPED_TRACE(::testing::Message() << threads << " threads, copies " << mask
                                            << (along_rows ? ", row blocks" : ", column blocks"));
          std::vector<uint8_t> got(x.size(), 0x5A), got_t(x.size(), 0xA5);
          std::vector<float> g(grid, -3.0f), g_t(grid_t, -5.0f);
          float amax = -1.0f;
          cpu::QuantizeLineBlocks(x.data(), p.rows, p.cols, length, p.format.format,
                                  mask & 1 ? got.data() : nullptr, mask & 1 ? g.data() : nullptr,
                                  mask & 2 ? got_t.data() : nullptr,
                                  mask & 2 ? g_t.data() : nullptr, &amax);
          if (mask & 1) {
            ASSERT_EQ(got, ref);
            ASSERT_EQ(g, s);
          }
          if (mask & 2) {
            ASSERT_EQ(got_t, ref_t);
            ASSERT_EQ(g_t, s_t);
          }
          ASSERT_EQ(std::isnan(amax), std::isnan(ref_amax));
          if (!std::isnan(ref_amax)) {
            ASSERT_EQ(amax, ref_amax);
          }
        }
      });
    }
  }
  cpu::SetThreads(threads_before);
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (const FormatModel& f : {kE4M3, kE5M2}) {
    // BLOCK's 1x128 and 128x128, MXFP8's 1x32 rowwise and 32x1 columnwise, and odd shapes;
    // sizes below, at and past a block, primes, size 1.
    for (const auto& b :
         std::vector<std::pair<int64_t, int64_t>>{{1, 128}, {128, 128}, {1, 32}, {32, 1}, {3, 5}}) {
      for (const auto& s : std::vector<std::pair<int64_t, int64_t>>{{1, 1},
                                                                    {1, 127},
                                                                    {2, 128},
                                                                    {5, 300},
                                                                    {131, 129},
                                                                    {33, 31},
                                                                    {128, 256},
                                                                    {300, 1100}}) {
        cases.push_back({f, b.first, b.second, s.first, s.second});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, BlockQuantizeTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return CaseName(info.param); });

class BlockScaleExponentTest : public ::testing::TestWithParam<FormatModel> {};

TEST_P(BlockScaleExponentTest, MatchesSearchOnBoundariesAndRandomAmax) {
  const FormatModel f = GetParam();
  const double max = ModelMax(f);
  ASSERT_EQ(double(Fp8Max(f.format)), max);
  std::vector<float> amaxes{0.0f, FLT_MIN, std::nextafter(0.0f, 1.0f), FLT_MAX, 3e6f, 1.0f};
  // Every boundary max * 2^e of the float range and its neighbours.
  for (int e = -160; e <= 120; ++e) {
    const float b = float(std::ldexp(max, e));
    if (b == 0.0f || std::isinf(b)) continue;
    amaxes.push_back(b);
    amaxes.push_back(std::nextafter(b, 0.0f));
    amaxes.push_back(std::nextafter(b, INFINITY));
  }
  std::uniform_real_distribution<float> log2_amax(-149.0f, 127.9f);
  for (int i = 0; i < 4000; ++i) amaxes.push_back(std::exp2(log2_amax(Rng())));
  for (float a : amaxes) {
    if (std::isinf(a)) continue;
    const int want = ModelExponent(f, double(a));
    ASSERT_EQ(BlockScaleExponent(a, f.format), want) << "amax " << a;
    uint32_t bits;
    std::memcpy(&bits, &a, sizeof bits);
    ASSERT_EQ(cpu::ScaleExponentOfBits(bits, f.format), want) << "amax " << a;
    if (a > 0 && want > kBlockScaleExponentMin && want < kBlockScaleExponentMax) {
      // Inside the range: nothing saturates and the scale is not larger than it needs to be.
      ASSERT_LE(double(a), std::ldexp(max, want)) << a;
      ASSERT_GT(double(a), std::ldexp(max, want - 1)) << a;
    }
  }
  EXPECT_EQ(kBlockScaleExponentMin, -50);
  EXPECT_EQ(kBlockScaleExponentMax, 50);
  EXPECT_EQ(BlockScaleExponent(0.0f, f.format), 0);
  EXPECT_EQ(BlockScaleExponent(INFINITY, f.format), kBlockScaleExponentMax);
  EXPECT_EQ(BlockScaleExponent(FLT_MAX, f.format), kBlockScaleExponentMax);
  EXPECT_EQ(BlockScaleExponent(std::nextafter(0.0f, 1.0f), f.format), kBlockScaleExponentMin);
  EXPECT_EQ(BlockScaleExponent(float(max), f.format), 0);
  EXPECT_EQ(BlockScaleExponent(std::nextafter(float(max), INFINITY), f.format), 1);
}

// The point of block scaling: an outlier changes its own block and nothing else, and a block's
// finite values never saturate while its scale is in range.
TEST_P(BlockScaleExponentTest, OutlierCostsOnlyItsBlockAndNothingSaturates) {
  const FormatModel f = GetParam();
  const int64_t rows = 5, cols = 300;
  const BlockShape block{1, 32};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(rows * cols));
  for (float& v : x) v = normal(Rng());
  std::vector<uint8_t> clean(x.size()), dirty(x.size());
  const size_t grid = size_t(rows * BlockGridCols(cols, block));
  std::vector<float> s_clean(grid), s_dirty(grid);
  QuantizeBlocks(x.data(), rows, cols, block, f.format, clean.data(), s_clean.data(), nullptr,
                 nullptr);
  std::vector<float> y = x;
  const int64_t outlier = 2 * cols + 70;  // row 2, block 2 (columns 64..95)
  y[size_t(outlier)] = 3e6f;
  QuantizeBlocks(y.data(), rows, cols, block, f.format, dirty.data(), s_dirty.data(), nullptr,
                 nullptr);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = size_t(r * cols + c);
      if (r == 2 && c / 32 == 2) continue;
      EXPECT_EQ(dirty[i], clean[i]) << r << "," << c;
    }
  }
  std::vector<float> deq(x.size());
  DequantizeBlocks(dirty.data(), rows, cols, block, s_dirty.data(), f.format, deq.data());
  // The outlier itself: no saturation, within half a step of E4M3/E5M2 relative precision.
  EXPECT_NEAR(deq[size_t(outlier)], 3e6, 3e6 * std::ldexp(1.0, -f.mantissa_bits - 1));
  for (size_t i = 0; i < x.size(); ++i) {
    // The blocks of rows without the outlier: every value within relative half a step, or
    // within half of the smallest subnormal step of its block.
    const int64_t r = int64_t(i) / cols, c = int64_t(i) % cols;
    if (r == 2 && c / 32 == 2) continue;
    const double step = std::fabs(double(y[i])) * std::ldexp(1.0, -f.mantissa_bits - 1);
    const double floor_step =
        std::ldexp(double(s_dirty[size_t(r * BlockGridCols(cols, block) + c / 32)]),
                   1 - f.bias - f.mantissa_bits - 1);
    EXPECT_LE(std::fabs(deq[i] - double(y[i])), std::max(step, floor_step)) << r << "," << c;
  }
}

// The exponent range's promise to the GEMM: every nonzero dequantized value is a normal bf16
// (its low 16 bits zero, its exponent >= -126), in [2^-66, 2^66), for any finite input.
TEST_P(BlockScaleExponentTest, DequantizedValuesAreNormalBf16InTheDocumentedRange) {
  const FormatModel f = GetParam();
  const int64_t rows = 64, cols = 96;
  const std::vector<float> x = RandomBlocked(rows, cols, 1, 32);
  std::vector<uint8_t> codes(x.size());
  std::vector<float> scale(size_t(rows * 3)), deq(x.size());
  QuantizeBlocks(x.data(), rows, cols, BlockShape{1, 32}, f.format, codes.data(), scale.data(),
                 nullptr, nullptr);
  DequantizeBlocks(codes.data(), rows, cols, BlockShape{1, 32}, scale.data(), f.format, deq.data());
  int nonzero = 0;
  for (float v : deq) {
    if (std::isnan(v) || v == 0.0f) continue;
    ++nonzero;
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    EXPECT_EQ(bits & 0xFFFFu, 0u) << v;
    EXPECT_GE(std::fabs(double(v)), std::ldexp(1.0, -66)) << v;
    EXPECT_LT(std::fabs(double(v)), std::ldexp(1.0, 66)) << v;
    EXPECT_TRUE(std::isnormal(v)) << v;
  }
  EXPECT_GT(nonzero, 0);
  // Smallest nonzero product of two dequantized values across the formats: 2^-125 > 2^-126.
  const double smallest_e5m2 = std::ldexp(ModelDecode(kE5M2, 1), kBlockScaleExponentMin);
  const double smallest_e4m3 = std::ldexp(ModelDecode(kE4M3, 1), kBlockScaleExponentMin);
  EXPECT_GE(smallest_e5m2 * smallest_e4m3, std::ldexp(1.0, -126));
  EXPECT_LT(std::ldexp(ModelMax(kE5M2), kBlockScaleExponentMax) *
                std::ldexp(ModelMax(kE4M3), kBlockScaleExponentMax),
            std::ldexp(1.0, 126));
}

TEST_P(BlockScaleExponentTest, ZeroNanAndInfinityBlocks) {
  const FormatModel f = GetParam();
  // Block 0: zeros; block 1: NaNs; block 2: +-inf only; block 3: inf next to finite values;
  // block 4: huge (saturates at the top of the range); block 5: tiny (rounds on the grid of the
  // bottom of the range).
  const int64_t cols = 6 * 4;
  std::vector<float> x{0.0f,     -0.0f,     0.0f,     0.0f,     NAN,      -NAN,    NAN,    NAN,
                       INFINITY, -INFINITY, INFINITY, INFINITY, INFINITY, 1.5f,    -3.0f,  0.25f,
                       FLT_MAX,  -1e30f,    2e17f,    1.0f,     1e-15f,   -3e-14f, 1e-30f, 2e-14f};
  std::vector<uint8_t> codes(x.size());
  std::vector<float> scale(6), deq(x.size());
  QuantizeBlocks(x.data(), 1, cols, BlockShape{1, 4}, f.format, codes.data(), scale.data(), nullptr,
                 nullptr);
  DequantizeBlocks(codes.data(), 1, cols, BlockShape{1, 4}, scale.data(), f.format, deq.data());
  const double max = ModelMax(f);
  EXPECT_EQ(scale[0], 1.0f);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(deq[size_t(i)], 0.0f);
  EXPECT_EQ(codes[1], 0x80);  // -0 keeps its sign
  EXPECT_EQ(scale[1], 1.0f);
  for (int i = 4; i < 8; ++i) EXPECT_TRUE(std::isnan(deq[size_t(i)]));
  EXPECT_EQ(scale[2], 1.0f);  // no finite element: scale 1, infinities saturate
  EXPECT_EQ(double(deq[8]), max);
  EXPECT_EQ(double(deq[9]), -max);
  // inf beside finite values: the scale is the finite values' (3.0 -> 2^e >= 3/max).
  EXPECT_EQ(double(scale[3]), std::ldexp(1.0, ModelExponent(f, 3.0)));
  EXPECT_EQ(double(deq[12]), std::ldexp(max, ModelExponent(f, 3.0)));
  EXPECT_EQ(deq[13], 1.5f);
  EXPECT_EQ(deq[14], -3.0f);
  EXPECT_EQ(deq[15], 0.25f);
  // Huge: scale 2^50, FLT_MAX and -1e30 saturate to +-max * 2^50; 2e17 rounds on that grid and
  // 1.0 flushes to zero.
  EXPECT_EQ(scale[4], std::ldexp(1.0f, 50));
  EXPECT_EQ(double(deq[16]), std::ldexp(max, 50));
  EXPECT_EQ(double(deq[17]), -std::ldexp(max, 50));
  EXPECT_EQ(double(deq[18]),
            std::ldexp(ModelDecode(f, ModelEncode(f, std::ldexp(double(2e17f), -50))), 50));
  EXPECT_LT(double(deq[18]), std::ldexp(max, 50));
  EXPECT_EQ(deq[19], 0.0f);
  // Tiny: scale 2^-50; values round on that grid, 1e-30 flushes to zero.
  EXPECT_EQ(scale[5], std::ldexp(1.0f, -50));
  EXPECT_EQ(deq[22], 0.0f);
  EXPECT_EQ(double(deq[23]),
            std::ldexp(ModelDecode(f, ModelEncode(f, std::ldexp(double(2e-14f), 50))), -50));
  EXPECT_NE(deq[23], 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Formats, BlockScaleExponentTest, ::testing::Values(kE4M3, kE5M2),
                         [](const auto& info) {
                           return std::string(Fp8FormatName(info.param.format));
                         });

// Random values whose blocks take scale exponents across the whole clamped range and past it,
// cast with `block` and dequantized: a block-scaled GEMM operand.
std::vector<float> DequantizedOperand(const FormatModel& f, int64_t rows, int64_t cols,
                                      BlockShape block) {
  std::vector<float> x = RandomBlocked(rows, cols, block.rows, block.cols);
  for (float& v : x) {
    if (!std::isfinite(v)) v = 1.0f;  // finite operands: the sums are compared bit for bit
  }
  std::vector<uint8_t> codes(x.size());
  std::vector<float> scale(size_t(BlockGridRows(rows, block) * BlockGridCols(cols, block)));
  QuantizeBlocks(x.data(), rows, cols, block, f.format, codes.data(), scale.data(), nullptr,
                 nullptr);
  std::vector<float> out(x.size());
  DequantizeBlocks(codes.data(), rows, cols, block, scale.data(), f.format, out.data());
  return out;
}

// The block-scaled GEMM: the reference's ordered sum on dequantized operands (FloatGemm) is,
// bit for bit, every copy of the CPU's FP8 GEMM on the same values (a float A, B packed from
// floats) — over blocks whose exponents span the whole range, E4M3 x E4M3 and E5M2 x E4M3. And
// FloatGemm is the float64 sum of the same products within fp32 accumulation error.
TEST(BlockScaledGemm, OrderedGemmCopiesAreTheReferenceBitsAcrossTheExponentRange) {
  for (const FormatModel& fa : {kE4M3, kE5M2}) {
    for (const auto& [m, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {1, 1, 1}, {7, 13, 33}, {6, 17, 300}, {19, 40, 129}}) {
      SCOPED_TRACE(std::string(Fp8FormatName(fa.format)) + " " + std::to_string(m) + "x" +
                   std::to_string(n) + "x" + std::to_string(k));
      const std::vector<float> a = DequantizedOperand(fa, m, k, BlockShape{1, 32});
      const std::vector<float> b = DequantizedOperand(kE4M3, n, k, BlockShape{128, 128});
      std::vector<float> bias(static_cast<size_t>(n));
      for (size_t j = 0; j < bias.size(); ++j) bias[j] = float(j) * 0.25f - 1.0f;
      std::vector<float> want(size_t(m * n), NAN);
      FloatGemm(a.data(), b.data(), m, n, k, want.data(), bias.data(), false);
      // Float64 of the same products: the fp32 sum is within k * 2^-24 * sum |products|.
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double exact = bias[size_t(j)], terms = std::fabs(bias[size_t(j)]);
          for (int64_t d = 0; d < k; ++d) {
            const double p = double(a[size_t(i * k + d)]) * double(b[size_t(j * k + d)]);
            exact += p;
            terms += std::fabs(p);
          }
          if (!std::isfinite(want[size_t(i * n + j)])) {  // a partial sum past fp32's range
            ASSERT_GT(terms, std::ldexp(1.0, 127)) << i << "," << j;
            continue;
          }
          ASSERT_LE(std::fabs(double(want[size_t(i * n + j)]) - exact),
                    double(k + 2) * std::ldexp(1.0, -24) * terms + 1e-300)
              << i << "," << j;
        }
      }
      std::vector<uint16_t> panels(cpu::PanelBytes(n, k) / 2 + 1);
      cpu::PackPanels(b.data(), n, k, k, /*n_major=*/true, panels.data());
      for (cpu::OrderedGemmCopy copy :
           {cpu::OrderedGemmCopy::kBaseline, cpu::OrderedGemmCopy::kAvx2,
            cpu::OrderedGemmCopy::kAvx512}) {
        if (!cpu::OrderedGemmCopySupported(copy)) continue;
        std::vector<float> got(size_t(m * n), NAN);
        cpu::OrderedGemmArgs g;
        g.m = m;
        g.a = a.data();
        g.lda = k;
        g.b = {n, k, panels.data()};
        g.scale = 1.0f;
        g.bias = bias.data();
        g.c = got.data();
        g.ldc = n;
        cpu::OrderedGemmUsing(copy, g);
        ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
            << cpu::OrderedGemmCopyName(copy);
      }
    }
  }
}

TEST(BlockScalingConstants, RecipeBlockShapes) {
  EXPECT_EQ(kBlockScalingEdge, 128);
  EXPECT_EQ(kMxfp8BlockLength, 32);
  EXPECT_EQ(BlockGridRows(0, BlockShape{128, 128}), 0);
  EXPECT_EQ(BlockGridCols(129, BlockShape{1, 128}), 2);
  EXPECT_EQ(BlockGridCols(128, BlockShape{1, 128}), 1);
  EXPECT_EQ(BlockGridRows(33, BlockShape{32, 1}), 2);
}

}  // namespace
}  // namespace gradwire::kernels
