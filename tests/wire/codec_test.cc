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
#include "gradwire/kernels/ref/block_scaling.h"
#include "gradwire/kernels/ref/cast.h"
#include "gradwire/wire/chunking.h"
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

// Block-scaled FP8 (docs/wire.md, "Block scales"): the codes and scales are the reference block
// cast's, both copies; the message carries them and decodes to the codes times their block's
// scale; every malformed field is refused, named.
TEST(WireTensor, BlockScaledTensorsAreTheReferenceCastBothWays) {
  const int64_t rows = 37, cols = 300;  // partial blocks at both edges
  std::vector<float> x = Random(rows * cols, 3.0f, 17);
  x[5 * cols + 7] = 3e6f;  // an outlier costs only its own block
  x[9 * cols + 200] = NAN;
  x[11 * cols + 3] = -INFINITY;
  for (int64_t c = 0; c < 128; ++c) x[20 * cols + c] = 0.0f;  // a block of zeros
  for (DType dtype : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    const kernels::Fp8Format format =
        dtype == DType::kFp8E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2;
    for (int64_t block : {128, 32}) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " block " + std::to_string(block));
      v1::Tensor m;
      EncodeToMessage(x.data(), {rows, cols}, dtype, &m, {block, /*columnwise=*/true});
      EXPECT_EQ(m.scale_inv(), 0.0f);
      ASSERT_EQ(m.data().size(), size_t(2 * rows * cols));
      // The reference: rowwise 1 x block, and x blocked block x 1, transposed.
      const int64_t gc = (cols + block - 1) / block, gr = (rows + block - 1) / block;
      std::vector<uint8_t> codes(size_t(rows * cols)), codes_t(size_t(rows * cols));
      std::vector<float> scales(size_t(rows * gc)), scales_t(size_t(cols * gr));
      kernels::QuantizeBlocks(x.data(), rows, cols, {1, block}, format, codes.data(), scales.data(),
                              nullptr, nullptr);
      kernels::QuantizeBlocks(x.data(), rows, cols, {block, 1}, format, nullptr, nullptr,
                              codes_t.data(), scales_t.data());
      EXPECT_EQ(std::memcmp(m.data().data(), codes.data(), codes.size()), 0);
      EXPECT_EQ(std::memcmp(m.data().data() + rows * cols, codes_t.data(), codes_t.size()), 0);
      ASSERT_EQ(m.block_scales().block_rows(), 1);
      ASSERT_EQ(m.block_scales().block_cols(), block);
      ASSERT_EQ(m.block_scales().scale_inv().size(), scales.size() * 4);
      EXPECT_EQ(std::memcmp(m.block_scales().scale_inv().data(), scales.data(), scales.size() * 4),
                0);
      ASSERT_EQ(m.columnwise_scales().block_rows(), 1);
      ASSERT_EQ(m.columnwise_scales().block_cols(), block);
      ASSERT_EQ(m.columnwise_scales().scale_inv().size(), scales_t.size() * 4);
      EXPECT_EQ(std::memcmp(m.columnwise_scales().scale_inv().data(), scales_t.data(),
                            scales_t.size() * 4),
                0);
      auto view = ViewOf(m, "input");
      ASSERT_TRUE(view.ok()) << view.status();
      EXPECT_EQ(view->bytes(), 2 * rows * cols);
      EXPECT_TRUE(view->blocks.PowersOfTwoInRange());
      EXPECT_TRUE(view->columnwise.PowersOfTwoInRange());
      auto decoded = DecodeMessage(m, "input");
      ASSERT_TRUE(decoded.ok());
      std::vector<float> want(size_t(rows * cols));
      kernels::DequantizeBlocks(codes.data(), rows, cols, {1, block}, scales.data(), format,
                                want.data());
      size_t differ = 0;
      for (size_t i = 0; i < want.size(); ++i) differ += Bits(want[i]) != Bits((*decoded)[i]);
      EXPECT_EQ(differ, 0u);
      // Rows other than the outlier's keep their precision.
      for (int64_t c = 0; c < cols; ++c) {
        const float v = x[6 * cols + c];
        EXPECT_NEAR((*decoded)[size_t(6 * cols + c)], v, std::fabs(v) * 0.13f + 1e-6f) << c;
      }
      // Without the columnwise copy: the codes alone.
      v1::Tensor one;
      EncodeToMessage(x.data(), {rows, cols}, dtype, &one, {block, false});
      EXPECT_EQ(one.data().size(), size_t(rows * cols));
      EXPECT_FALSE(one.has_columnwise_scales());
      auto again = DecodeMessage(one, "input");
      ASSERT_TRUE(again.ok());
      differ = 0;
      for (size_t i = 0; i < want.size(); ++i) differ += Bits(want[i]) != Bits((*again)[i]);
      EXPECT_EQ(differ, 0u);
    }
  }
}

TEST(WireTensor, MalformedBlockScalesAreRefusedAndNamed) {
  const std::vector<float> x = Random(4 * 40, 1.0f, 5);
  v1::Tensor good;
  EncodeToMessage(x.data(), {4, 40}, DType::kFp8E4M3, &good, {32, true});
  ASSERT_TRUE(ViewOf(good, "input").ok());
  auto refused = [](const v1::Tensor& t, const std::string& words) {
    auto v = ViewOf(t, "input");
    ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << words;
    EXPECT_NE(v.status().message().find(words), absl::string_view::npos) << v.status();
  };
  v1::Tensor both = good;
  both.set_scale_inv(1.0f);
  refused(both, "both scale_inv");
  v1::Tensor not_fp8 = good;
  not_fp8.set_dtype(v1::BF16);
  not_fp8.set_data(std::string(4 * 40 * 2, '\0'));
  refused(not_fp8, "only FP8 tensors have scales");
  v1::Tensor zero_block = good;
  zero_block.mutable_block_scales()->set_block_cols(0);
  refused(zero_block, "at least 1 x 1");
  v1::Tensor huge_block = good;  // no grid arithmetic may overflow
  huge_block.mutable_block_scales()->set_block_cols(std::numeric_limits<int64_t>::max());
  refused(huge_block, "at most 2147483648 a side");
  v1::Tensor short_grid = good;
  short_grid.mutable_block_scales()->mutable_scale_inv()->resize(4);
  refused(short_grid, "input.block_scales.scale_inv has 4 bytes");
  v1::Tensor bad_scale = good;
  const float nan = NAN;
  bad_scale.mutable_block_scales()->mutable_scale_inv()->replace(
      4, 4, reinterpret_cast<const char*>(&nan), 4);
  refused(bad_scale, "input.block_scales.scale_inv[1] must be finite and > 0");
  v1::Tensor negative = good;
  const float minus = -0.5f;
  negative.mutable_columnwise_scales()->mutable_scale_inv()->replace(
      0, 4, reinterpret_cast<const char*>(&minus), 4);
  refused(negative, "input.columnwise_scales.scale_inv[0]");
  v1::Tensor lone_columnwise = good;
  lone_columnwise.clear_block_scales();
  lone_columnwise.set_scale_inv(1.0f);
  refused(lone_columnwise, "columnwise_scales needs block_scales");
  v1::Tensor one_copy_of_data = good;
  one_copy_of_data.mutable_data()->resize(4 * 40);
  refused(one_copy_of_data, "input.data has 160 bytes");
  EXPECT_EQ(*DataBytes(good, "input"), 2 * 4 * 40);
  // Scales that are not powers of two in the block range are accepted, but are not a recipe's.
  v1::Tensor odd = good;
  const float third = 1.0f / 3.0f;
  odd.mutable_block_scales()->mutable_scale_inv()->replace(
      0, 4, reinterpret_cast<const char*>(&third), 4);
  auto v = ViewOf(odd, "input");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE(v->blocks.PowersOfTwoInRange());
  EXPECT_TRUE(v->columnwise.PowersOfTwoInRange());
  BlockScales wide{1, 32, {std::ldexp(1.0f, 51)}};
  EXPECT_FALSE(wide.PowersOfTwoInRange());
  wide.scale_inv = {std::ldexp(1.0f, 50), std::ldexp(1.0f, -50)};
  EXPECT_TRUE(wide.PowersOfTwoInRange());
}

}  // namespace
}  // namespace gradwire::wire
