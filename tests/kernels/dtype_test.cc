// bf16 / half conversions used on the wire, against float64 round-to-nearest-even models.
#include "gradwire/kernels/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

namespace gradwire::kernels {
namespace {

// Nearest value with `mantissa_bits` stored bits, ties to even, for normal-range floats.
double RoundMantissa(double x, int mantissa_bits) {
  int e;
  std::frexp(x, &e);  // x = f * 2^e, f in [0.5, 1)
  const double quantum = std::ldexp(1.0, e - 1 - mantissa_bits);
  return std::nearbyint(x / quantum) * quantum;  // default rounding mode: ties to even
}

TEST(DtypeTest, Bf16RoundsToNearestEvenAndRoundTrips) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> dist(0.0f, 100.0f);
  for (int i = 0; i < 20000; ++i) {
    const float v = dist(rng);
    const float back = Bf16ToFloat(FloatToBf16(v));
    ASSERT_EQ(double(back), RoundMantissa(double(v), 7)) << v;
    ASSERT_EQ(Bf16ToFloat(FloatToBf16(back)), back);
  }
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(INFINITY)), INFINITY);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.00390625f)), 1.0f);       // tie, even is down
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.01171875f)), 1.015625f);  // tie, even is up
}

TEST(DtypeTest, HalfRoundsToNearestEvenIncludingSubnormalsAndOverflow) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> log_magnitude(-14.0f, 15.9f);
  for (int i = 0; i < 20000; ++i) {
    const float v = std::exp2(log_magnitude(rng));
    ASSERT_EQ(double(HalfToFloat(FloatToHalf(v))), RoundMantissa(double(v), 10)) << v;
    ASSERT_EQ(HalfToFloat(FloatToHalf(-v)), -HalfToFloat(FloatToHalf(v)));
  }
  for (int bits = 1; bits < 0x400; ++bits) {  // every subnormal round-trips exactly
    const float v = std::ldexp(float(bits), -24);
    ASSERT_EQ(FloatToHalf(v), bits);
    ASSERT_EQ(HalfToFloat(uint16_t(bits)), v);
  }
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0);  // half the min subnormal: tie to 0
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -24)), 2);  // tie between 1 and 2: even
  EXPECT_EQ(HalfToFloat(FloatToHalf(65504.0f)), 65504.0f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(65519.0f)), 65504.0f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(65520.0f)), INFINITY);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(NAN))));
}

}  // namespace
}  // namespace gradwire::kernels
