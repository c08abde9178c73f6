// Reference FP8 GEMM and casts against float64 on the dequantized operands.
#include "gradwire/kernels/ref/gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "gradwire/kernels/ref/cast.h"
#include "random_codes.h"

namespace gradwire::kernels {
namespace {

using test_data::RandomNormal;

// Random FP8 codes of finite values: a random tensor cast at its current scale.
std::vector<uint8_t> RandomCodes(int64_t n, Fp8Format format, float* scale_inv) {
  return test_data::RandomCodes(n, format, 3.0f, scale_inv);
}

TEST(QuantizeTest, RowwiseColumnwiseAndAmaxAgree) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {7, 13}, {64, 3}, {1, 31}}) {
    const std::vector<float> x = RandomNormal(rows * cols, 2.0f);
    const float scale = 17.0f;
    std::vector<uint8_t> out(static_cast<size_t>(rows * cols), 0xAA);  // poisoned
    std::vector<uint8_t> out_t(static_cast<size_t>(rows * cols), 0xAA);
    float amax = -1.0f;
    QuantizeFp8(x.data(), rows, cols, scale, Fp8Format::kE5M2, out.data(), out_t.data(), &amax);
    double expected_amax = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float v = x[size_t(r * cols + c)];
        expected_amax = std::max(expected_amax, std::fabs(double(v)));
        ASSERT_EQ(out[size_t(r * cols + c)], EncodeFp8(v * scale, Fp8Format::kE5M2));
        ASSERT_EQ(out_t[size_t(c * rows + r)], out[size_t(r * cols + c)]);
      }
    }
    EXPECT_EQ(double(amax), expected_amax);
    std::vector<uint8_t> transposed(out.size());
    TransposeCodes(out.data(), rows, cols, transposed.data());
    EXPECT_EQ(transposed, out_t);
  }
}

TEST(QuantizeTest, AmaxPropagatesNan) {
  std::vector<float> x = RandomNormal(9, 1.0f);
  x[4] = NAN;
  EXPECT_TRUE(std::isnan(Amax(x.data(), 9)));
  float amax = 0;
  std::vector<uint8_t> codes(9);
  QuantizeFp8(x.data(), 3, 3, 1.0f, Fp8Format::kE4M3, codes.data(), nullptr, &amax);
  EXPECT_TRUE(std::isnan(amax));
  EXPECT_TRUE(std::isnan(DecodeFp8(codes[4], Fp8Format::kE4M3)));
}

TEST(QuantizeTest, DequantizeAppliesScaleInv) {
  std::vector<uint8_t> codes = {0x00, 0x38, 0xB8, 0x7E};  // 0, 1, -1, 448 in E4M3
  std::vector<float> out(4, NAN);
  DequantizeFp8(codes.data(), 4, 0.5f, Fp8Format::kE4M3, out.data());
  EXPECT_EQ(out, (std::vector<float>{0.0f, 0.5f, -0.5f, 224.0f}));
}

TEST(QuantizeTest, ColumnSums) {
  const std::vector<float> x = {1, 2, 3, 4, 5, 6};  // [2, 3]
  std::vector<float> sums(3, NAN);
  ColumnSums(x.data(), 2, 3, sums.data());
  EXPECT_EQ(sums, (std::vector<float>{5, 7, 9}));
}

// (m, n, k, a transposed, b transposed)
using GemmCase = std::tuple<int64_t, int64_t, int64_t, bool, bool>;

class Fp8GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(Fp8GemmTest, MatchesFloat64OnDequantizedOperands) {
  const auto [m, n, k, ta, tb] = GetParam();
  float sa = 0, sb = 0;
  const std::vector<uint8_t> a = RandomCodes(m * k, Fp8Format::kE4M3, &sa);
  const std::vector<uint8_t> b = RandomCodes(k * n, Fp8Format::kE5M2, &sb);
  const std::vector<float> bias = RandomNormal(n, 1.0f);
  const std::vector<float> start = RandomNormal(m * n, 1.0f);
  for (bool use_bias : {false, true}) {
    for (bool accumulate : {false, true}) {
      std::vector<float> c = start;
      if (!accumulate) std::fill(c.begin(), c.end(), NAN);  // poison: every output is written
      Fp8GemmArgs args;
      args.a = {a.data(), Fp8Format::kE4M3, sa, ta};
      args.b = {b.data(), Fp8Format::kE5M2, sb, tb};
      args.m = m;
      args.n = n;
      args.k = k;
      args.c = c.data();
      args.bias = use_bias ? bias.data() : nullptr;
      args.accumulate = accumulate;
      Fp8Gemm(args);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double ref = 0, magnitude = 0;
          for (int64_t p = 0; p < k; ++p) {
            const uint8_t ca = ta ? a[size_t(p * m + i)] : a[size_t(i * k + p)];
            const uint8_t cb = tb ? b[size_t(j * k + p)] : b[size_t(p * n + j)];
            const double prod = double(DecodeFp8(ca, Fp8Format::kE4M3)) * sa *
                                double(DecodeFp8(cb, Fp8Format::kE5M2)) * sb;
            ref += prod;
            magnitude += std::fabs(prod);
          }
          if (use_bias) ref += bias[size_t(j)], magnitude += std::fabs(bias[size_t(j)]);
          if (accumulate)
            ref += start[size_t(i * n + j)], magnitude += std::fabs(start[size_t(i * n + j)]);
          // fp32 accumulation in 8 lanes: error grows with k/8 ulps of the magnitude.
          const double tol = (double(k) / 8 + 4) * std::ldexp(1.0, -23) * magnitude + 1e-30;
          ASSERT_NEAR(c[size_t(i * n + j)], ref, tol)
              << "i=" << i << " j=" << j << " bias=" << use_bias << " acc=" << accumulate;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ShapesAndLayouts, Fp8GemmTest,
                         ::testing::Combine(::testing::Values(1, 7, 33),
                                            ::testing::Values(1, 5, 64),
                                            ::testing::Values(1, 13, 128), ::testing::Bool(),
                                            ::testing::Bool()));

}  // namespace
}  // namespace gradwire::kernels
