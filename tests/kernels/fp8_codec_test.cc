// FP8 codecs of the reference backend against an independent float64 model of each format.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "fp8_model.h"
#include "gradwire/kernels/fp8.h"

namespace gradwire::kernels {
namespace {

void PrintTo(const FormatModel& f, std::ostream* os) { *os << Fp8FormatName(f.format); }

class Fp8CodecTest : public ::testing::TestWithParam<FormatModel> {};

TEST_P(Fp8CodecTest, DecodeMatchesFormatDefinitionForAll256Codes) {
  const FormatModel f = GetParam();
  for (int code = 0; code < 256; ++code) {
    const double expected = ModelDecode(f, code);
    const float got = DecodeFp8(uint8_t(code), f.format);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << code;
    } else {
      EXPECT_EQ(double(got), expected) << "code " << code;
      EXPECT_EQ(std::signbit(got), bool(code & 0x80)) << "code " << code;
    }
    const float table = DecodeTable(f.format)[code];
    EXPECT_TRUE(table == got || (std::isnan(table) && std::isnan(got))) << "code " << code;
  }
}

TEST_P(Fp8CodecTest, EveryCodeRoundTrips) {
  const FormatModel f = GetParam();
  int finite = 0;
  for (int code = 0; code < 256; ++code) {
    const float v = DecodeFp8(uint8_t(code), f.format);
    const uint8_t back = EncodeFp8(v, f.format);
    if (std::isnan(v)) {
      EXPECT_TRUE(IsNanCode(f, back)) << "NaN code " << code << " came back as " << int(back);
    } else if (std::isinf(v)) {  // E5M2 infinities saturate to the largest finite value
      EXPECT_EQ(back, (code & 0x80) | 0x7B) << "inf code " << code;
    } else {
      EXPECT_EQ(back, code) << "value " << v;
      ++finite;
    }
  }
  // E4M3: 256 - 2 NaNs; E5M2: 256 - 6 NaNs - 2 infinities.
  EXPECT_EQ(finite, f.format == Fp8Format::kE4M3 ? 254 : 248);
}

TEST_P(Fp8CodecTest, LimitsAreTheFormatsOwn) {
  const FormatModel f = GetParam();
  double max = 0, min_subnormal = INFINITY;
  for (int code = 1; code < 128; ++code) {
    const double v = ModelDecode(f, code);
    if (std::isfinite(v)) max = std::max(max, v), min_subnormal = std::min(min_subnormal, v);
  }
  EXPECT_EQ(double(Fp8Max(f.format)), max);
  EXPECT_EQ(f.format == Fp8Format::kE4M3 ? 448.0 : 57344.0, max);
  EXPECT_EQ(min_subnormal,
            f.format == Fp8Format::kE4M3 ? std::ldexp(1.0, -9) : std::ldexp(1.0, -16));
}

std::vector<float> EdgeValues(const FormatModel& f) {
  std::vector<double> finite;
  for (int code = 0; code < 128; ++code) {
    const double v = ModelDecode(f, code);
    if (std::isfinite(v)) finite.push_back(v);
  }
  std::sort(finite.begin(), finite.end());
  std::vector<float> out;
  for (size_t i = 0; i < finite.size(); ++i) {
    const float v = float(finite[i]);
    out.push_back(v);
    out.push_back(std::nextafter(v, 0.0f));
    out.push_back(std::nextafter(v, INFINITY));
    if (i + 1 < finite.size()) {
      const float mid = float((finite[i] + finite[i + 1]) / 2);  // exact: one more bit
      out.push_back(mid);                                        // a tie
      out.push_back(std::nextafter(mid, 0.0f));
      out.push_back(std::nextafter(mid, INFINITY));
    }
  }
  const double max = finite.back();
  const double min_sub = finite[1];
  for (float v : {float(max * 1.0625), float(max * 1.125), float(max * 2), FLT_MAX, INFINITY,
                  float(min_sub / 2), float(min_sub / 4), std::nextafter(float(min_sub / 2), 1.0f),
                  1e-30f, FLT_MIN, std::nextafter(0.0f, 1.0f), 0.0f}) {
    out.push_back(v);
  }
  const size_t n = out.size();
  for (size_t i = 0; i < n; ++i) out.push_back(-out[i]);
  return out;
}

TEST_P(Fp8CodecTest, EncodeMatchesFloat64ReferenceOnEdgeValues) {
  const FormatModel f = GetParam();
  for (float v : EdgeValues(f)) {
    const int expected = ModelEncode(f, double(v));
    EXPECT_EQ(int(EncodeFp8(v, f.format)), expected) << "value " << v;
  }
}

TEST_P(Fp8CodecTest, EncodeMatchesFloat64ReferenceOnRandomValues) {
  const FormatModel f = GetParam();
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> log_magnitude(-20.0f, 18.0f);
  std::bernoulli_distribution negative(0.5);
  for (int i = 0; i < 20000; ++i) {
    float v = std::exp2(log_magnitude(rng));
    if (negative(rng)) v = -v;
    ASSERT_EQ(int(EncodeFp8(v, f.format)), ModelEncode(f, double(v))) << "value " << v;
  }
}

TEST_P(Fp8CodecTest, NanStaysNanAndInfinitySaturates) {
  const FormatModel f = GetParam();
  EXPECT_TRUE(IsNanCode(f, EncodeFp8(NAN, f.format)));
  EXPECT_TRUE(IsNanCode(f, EncodeFp8(-NAN, f.format)));
  EXPECT_EQ(DecodeFp8(EncodeFp8(INFINITY, f.format), f.format), Fp8Max(f.format));
  EXPECT_EQ(DecodeFp8(EncodeFp8(-INFINITY, f.format), f.format), -Fp8Max(f.format));
  EXPECT_EQ(EncodeFp8(-0.0f, f.format), 0x80);
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8CodecTest, ::testing::Values(kE4M3, kE5M2),
                         [](const auto& info) {
                           return std::string(Fp8FormatName(info.param.format));
                         });

TEST(ComputeScaleTest, FormulaWithMargin) {
  EXPECT_FLOAT_EQ(ComputeScale(2.0f, Fp8Format::kE4M3, 0), 224.0f);
  EXPECT_FLOAT_EQ(ComputeScale(2.0f, Fp8Format::kE4M3, 1), 112.0f);
  EXPECT_FLOAT_EQ(ComputeScale(57344.0f, Fp8Format::kE5M2, 0), 1.0f);
  EXPECT_FLOAT_EQ(ComputeScale(0.5f, Fp8Format::kE5M2, 3), 57344.0f * 2 / 8);
}

TEST(ComputeScaleTest, EdgeCasesOfAmax) {
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    EXPECT_EQ(ComputeScale(0.0f, f, 0), 1.0f);
    EXPECT_EQ(ComputeScale(INFINITY, f, 0), 1.0f);
    EXPECT_EQ(ComputeScale(NAN, f, 0), 1.0f);
    EXPECT_EQ(ComputeScale(-1.0f, f, 0), 1.0f);
    EXPECT_EQ(ComputeScale(1e-40f, f, 0), FLT_MAX);  // would overflow to inf
  }
}

}  // namespace
}  // namespace gradwire::kernels
