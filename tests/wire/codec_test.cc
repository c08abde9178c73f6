// The wire codec (gradwire/wire/codec.h) and its message helpers (gradwire/wire/tensor.h): the one
// encoder/decoder the server's backends and the C++ client share. Checked against the reference
// element math it is defined by, on every FP8 code and on fresh random values, at aligned and
// unaligned addresses.
#include "gradwire/wire/codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gradwire/kernels/dtype.h"
#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/cast.h"
#include "gradwire/wire/tensor.h"

namespace gradwire::wire {
namespace {

uint32_t Bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}

std::vector<float> Random(int64_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = dist(rng);
  return x;
}

TEST(WireCodec, ElementSizesAndNames) {
  EXPECT_EQ(ElementSize(DType::kF32), 4);
  EXPECT_EQ(ElementSize(DType::kBF16), 2);
  EXPECT_EQ(ElementSize(DType::kF16), 2);
  EXPECT_EQ(ElementSize(DType::kFp8E4M3), 1);
  EXPECT_EQ(ElementSize(DType::kFp8E5M2), 1);
  EXPECT_STREQ(DTypeName(DType::kFp8E5M2), "FP8_E5M2");
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kFp8E4M3, DType::kFp8E5M2}) {
    auto back = FromProto(ToProto(d), "dtype");
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, d);
  }
}

TEST(WireCodec, EveryFp8CodeDecodesAsTheReference) {
  for (DType d : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    const auto format =
        d == DType::kFp8E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2;
    // Behind one byte of padding as well: decoders must not assume alignment.
    std::vector<uint8_t> codes(257);
    for (int c = 0; c < 256; ++c) codes[size_t(c) + 1] = uint8_t(c);
    std::vector<float> out(256);
    const float scale_inv = 0.03125f * 3.0f;
    DecodeElements(d, codes.data() + 1, 256, scale_inv, out.data());
    for (int c = 0; c < 256; ++c) {
      const float want = kernels::DecodeFp8(uint8_t(c), format) * scale_inv;
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(out[size_t(c)])) << DTypeName(d) << " code " << c;
      } else {
        EXPECT_EQ(Bits(out[size_t(c)]), Bits(want)) << DTypeName(d) << " code " << c;
      }
    }
  }
}

TEST(WireCodec, SixteenBitRoundTripsMatchTheReferenceAtAnyAlignment) {
  const int64_t n = 5000;  // past the codec's staging block
  const std::vector<float> x = Random(n, 40.0f, 1);
  for (DType d : {DType::kBF16, DType::kF16}) {
    std::string bytes(size_t(n * 2 + 1), '\0');
    EncodeElements(x.data(), n, d, 1.0f, bytes.data() + 1);  // unaligned destination
    std::vector<uint16_t> want(static_cast<size_t>(n));
    if (d == DType::kBF16) {
      kernels::FloatToBf16(x.data(), n, want.data());
    } else {
      kernels::FloatToHalf(x.data(), n, want.data());
    }
    ASSERT_EQ(std::memcmp(bytes.data() + 1, want.data(), size_t(n * 2)), 0) << DTypeName(d);
    std::vector<float> decoded(static_cast<size_t>(n)), reference(static_cast<size_t>(n));
    DecodeElements(d, bytes.data() + 1, n, 1.0f, decoded.data());
    if (d == DType::kBF16) {
      kernels::Bf16ToFloat(want.data(), n, reference.data());
    } else {
      kernels::HalfToFloat(want.data(), n, reference.data());
    }
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(Bits(decoded[size_t(i)]), Bits(reference[size_t(i)])) << DTypeName(d) << " " << i;
    }
  }
}

TEST(WireCodec, Fp8TensorEncodingUsesItsOwnAmax) {
  const int64_t n = 3001;
  const std::vector<float> x = Random(n, 7.0f, 2);
  for (DType d : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    const auto format =
        d == DType::kFp8E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2;
    std::string bytes(size_t(n), '\0');
    const float scale_inv = EncodeTensor(x.data(), n, d, bytes.data());
    const float scale = kernels::ComputeScale(kernels::Amax(x.data(), n), format, 0);
    EXPECT_EQ(Bits(scale_inv), Bits(1.0f / scale));
    std::vector<uint8_t> want(static_cast<size_t>(n));
    kernels::QuantizeFp8(x.data(), 1, n, scale, format, want.data(), nullptr, nullptr);
    EXPECT_EQ(std::memcmp(bytes.data(), want.data(), size_t(n)), 0) << DTypeName(d);
    // The largest |x| lands on the format's largest value.
    std::vector<float> back(static_cast<size_t>(n));
    DecodeElements(d, bytes.data(), n, scale_inv, back.data());
    float amax_back = 0;
    for (float v : back) amax_back = std::max(amax_back, std::fabs(v));
    EXPECT_NEAR(amax_back, kernels::Amax(x.data(), n), 1e-5 * kernels::Amax(x.data(), n));
  }
}

// The codec encodes FP8 with the CPU kernels' encoder: the reference cast's codes on values over
// every binade, both signs, past the format's range and below its subnormals, with infinities and
// NaNs, at any alignment.
TEST(WireCodec, Fp8ElementsAreTheReferenceCastsCodes) {
  const int64_t n = 20000;
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(seed);
  std::vector<float> x = Random(n, 1.0f, seed);
  std::mt19937 rng(seed + 1);
  std::uniform_int_distribution<int> exponent(-40, 40);
  for (float& v : x) v = std::ldexp(v, exponent(rng));
  x[5] = std::numeric_limits<float>::infinity();
  x[6] = -std::numeric_limits<float>::infinity();
  x[7] = std::numeric_limits<float>::quiet_NaN();
  x[8] = -0.0f;
  x[9] = std::numeric_limits<float>::denorm_min();
  for (DType d : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    const auto format =
        d == DType::kFp8E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2;
    for (float scale : {1.0f, 3.0e-3f, 448.0f / 7.3f}) {
      std::string bytes(size_t(n + 3), '\0');
      EncodeElements(x.data(), n, d, scale, bytes.data() + 3);
      std::vector<uint8_t> want(static_cast<size_t>(n));
      kernels::QuantizeFp8(x.data(), 1, n, scale, format, want.data(), nullptr, nullptr);
      EXPECT_EQ(std::memcmp(bytes.data() + 3, want.data(), size_t(n)), 0)
          << DTypeName(d) << " scale " << scale;
    }
  }
}

TEST(WireTensor, ViewOfChecksEveryFieldAndNamesIt) {
  v1::Tensor t;
  t.set_dtype(v1::BF16);
  t.add_shape(3);
  t.add_shape(5);
  t.set_data(std::string(30, '\1'));
  auto ok = ViewOf(t, "input");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->dtype, DType::kBF16);
  EXPECT_EQ(ok->numel(), 15);
  EXPECT_EQ(ok->bytes(), 30);
  EXPECT_EQ(ok->data, t.data().data());  // a view: no copy

  v1::Tensor short_data = t;
  short_data.set_data(std::string(29, '\1'));
  auto s = ViewOf(short_data, "input");
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("input.data has 29 bytes"), absl::string_view::npos)
      << s.status();

  v1::Tensor unknown = t;
  unknown.set_dtype(static_cast<v1::DType>(42));
  auto u = ViewOf(unknown, "grad_output");
  ASSERT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(u.status().message().find("grad_output.dtype"), absl::string_view::npos);

  v1::Tensor fp8;
  fp8.set_dtype(v1::FP8_E4M3);
  fp8.add_shape(4);
  fp8.set_data(std::string(4, '\x10'));
  for (float bad : {0.0f, -1.0f, INFINITY, NAN}) {
    fp8.set_scale_inv(bad);
    auto f = ViewOf(fp8, "input");
    ASSERT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(f.status().message().find("input.scale_inv"), absl::string_view::npos);
  }
  fp8.set_scale_inv(0.5f);
  auto f = ViewOf(fp8, "input");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->scale_inv, 0.5f);

  EXPECT_TRUE(OutputDType(v1::DTYPE_UNSPECIFIED, "output_dtype").ok());
  EXPECT_EQ(*OutputDType(v1::DTYPE_UNSPECIFIED, "output_dtype"), DType::kF32);
  auto bad_out = OutputDType(static_cast<v1::DType>(9), "output_dtype");
  ASSERT_EQ(bad_out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_out.status().message().find("output_dtype"), absl::string_view::npos);
}

TEST(WireTensor, MessagesRoundTrip) {
  const std::vector<float> x = Random(24, 2.0f, 3);
  v1::Tensor m;
  EncodeToMessage(x.data(), {4, 6}, DType::kF32, &m);
  EXPECT_EQ(m.dtype(), v1::F32);
  ASSERT_EQ(m.shape_size(), 2);
  auto back = DecodeMessage(m, "t");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, x);  // F32 is exact

  v1::Tensor q;
  EncodeToMessage(x.data(), {4, 6}, DType::kFp8E5M2, &q);
  EXPECT_EQ(q.dtype(), v1::FP8_E5M2);
  EXPECT_EQ(q.data().size(), 24u);
  EXPECT_GT(q.scale_inv(), 0.0f);
  auto qb = DecodeMessage(q, "t");
  ASSERT_TRUE(qb.ok());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_NEAR((*qb)[i], x[i], 0.125 * std::fabs(x[i]) + 1e-3) << i;  // E5M2: 2 mantissa bits
  }
}

}  // namespace
}  // namespace gradwire::wire
