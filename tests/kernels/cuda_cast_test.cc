// CUDA casts, LayerNorm and activations against the reference backend on the same fresh random
// inputs. Casts of the same fp32 values are compared bit for bit (codes, transposed codes, amax,
// scale, scale_inv); fused producers (LayerNorm, activations) are compared to the reference within
// fp32 rounding, and their casts bit for bit against a reference cast of the fp32 values the
// kernel itself produced in the same pass. Skipped, visibly, where there is no CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "gradwire/kernels/cuda/activation.h"
#include "gradwire/kernels/cuda/cast.h"
#include "gradwire/kernels/cuda/layernorm.h"
#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/activation.h"
#include "gradwire/kernels/ref/cast.h"
#include "gradwire/kernels/ref/layernorm.h"

namespace gradwire::kernels::cuda {
namespace {

using testing::Bits;
using testing::DeviceBuffer;
using testing::FreshSeed;
using testing::RandomNormal;

struct Shape {
  int64_t rows, cols;
};
const Shape kShapes[] = {{0, 5},   {1, 1},    {1, 17},     {17, 1},     {31, 33},
                         {64, 64}, {127, 61}, {257, 1031}, {1024, 4096}};

// The device results of one cast.
struct CastResult {
  std::vector<uint8_t> data, data_t;
  float amax, scale, scale_inv;
};

// The reference backend's cast of x: what the server's Quantize does on the CPU.
CastResult ReferenceCast(const std::vector<float>& x, int64_t rows, int64_t cols, Fp8Format format,
                         bool current, int margin, float delayed_scale) {
  CastResult r;
  r.data.resize(x.size());
  r.data_t.resize(x.size());
  r.amax = kernels::Amax(x.data(), int64_t(x.size()));
  r.scale = current ? ComputeScale(r.amax, format, margin) : delayed_scale;
  r.scale_inv = 1.0f / r.scale;
  QuantizeFp8(x.data(), rows, cols, r.scale, format, r.data.data(), r.data_t.data(), nullptr);
  return r;
}

// Device buffers for one cast and the Fp8Output that points at them.
struct DeviceCast {
  DeviceBuffer<uint8_t> data, data_t;
  DeviceBuffer<float> amax{1}, scale{1}, scale_inv{1};
  Fp8Output out;
  DeviceCast(size_t n, Fp8Format format, bool current, int margin, float delayed_scale)
      : data(n), data_t(n) {
    scale.Upload({delayed_scale});
    out.format = format;
    out.scale = scale.get();
    out.current = current;
    out.margin = margin;
    out.data = data.get();
    out.data_t = data_t.get();
    out.amax = amax.get();
    out.scale_inv = scale_inv.get();
  }
  CastResult Result() const {
    return {data.Download(), data_t.Download(), amax.Scalar(), scale.Scalar(), scale_inv.Scalar()};
  }
};

void ExpectSameBits(float got, float want, const char* what) {
  EXPECT_EQ(Bits(got), Bits(want)) << what << ": " << got << " vs " << want;
}

void ExpectSameCast(const CastResult& got, const CastResult& want) {
  int64_t bad = 0, bad_t = 0;
  for (size_t i = 0; i < want.data.size(); ++i) {
    bad += got.data[i] != want.data[i];
    bad_t += got.data_t[i] != want.data_t[i];
  }
  EXPECT_EQ(bad, 0) << "rowwise codes differ";
  EXPECT_EQ(bad_t, 0) << "transposed codes differ";
  ExpectSameBits(got.amax, want.amax, "amax");
  ExpectSameBits(got.scale, want.scale, "scale");
  ExpectSameBits(got.scale_inv, want.scale_inv, "scale_inv");
}

// dbias[c] against the reference's column sums of x[rows, cols]: fp32 sums in two orders, each
// within rows * 2^-24 of the exact sum, relative to sum |x|.
void ExpectColumnSums(const std::vector<float>& dbias, const std::vector<float>& x, int64_t rows,
                      int64_t cols) {
  std::vector<float> sums(static_cast<size_t>(cols));
  ColumnSums(x.data(), rows, cols, sums.data());
  for (int64_t c = 0; c < cols; ++c) {
    double abs_sum = 0;
    for (int64_t r = 0; r < rows; ++r) abs_sum += std::fabs(x[size_t(r * cols + c)]);
    const double tol = 2.0 * double(rows) * std::ldexp(1.0, -24) * abs_sum + 1e-30;
    ASSERT_NEAR(dbias[size_t(c)], sums[size_t(c)], tol) << "column " << c;
  }
}

class CudaCastTest : public ::testing::TestWithParam<std::tuple<Fp8Format, Shape, bool>> {};

// Delayed scaling with a scale that saturates the largest values, and current scaling with a
// margin: both bit-exact.
TEST_P(CudaCastTest, CastTransposeAmaxBitExact) {
  GW_REQUIRE_CUDA_DEVICE();
  const auto [format, shape, current] = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<float> x = RandomNormal(shape.rows * shape.cols, seed, 3.0f);
  // Tiny values too, so subnormal FP8 codes and flush to zero are exercised.
  for (size_t i = 0; i < x.size(); i += 7) x[i] *= 1e-4f;
  const float amax = kernels::Amax(x.data(), int64_t(x.size()));
  const float delayed_scale = ComputeScale(amax * 0.6f, format, 0);
  const int margin = current ? 1 : 0;
  const CastResult want =
      ReferenceCast(x, shape.rows, shape.cols, format, current, margin, delayed_scale);
  DeviceBuffer<float> dx(x);
  DeviceCast cast(x.size(), format, current, margin, delayed_scale);
  CastTranspose(dx.get(), shape.rows, shape.cols, cast.out, nullptr);
  ExpectSameCast(cast.Result(), want);
}

// x truncated to bfloat16 (any bf16 pattern will do), as raw bits and as their exact fp32
// widening.
struct Bf16Values {
  std::vector<uint16_t> bits;
  std::vector<float> widened;
};
Bf16Values Bf16Of(const std::vector<float>& x) {
  Bf16Values v{std::vector<uint16_t>(x.size()), std::vector<float>(x.size())};
  for (size_t i = 0; i < x.size(); ++i) {
    v.bits[i] = uint16_t(Bits(x[i]) >> 16);
    const uint32_t w = uint32_t(v.bits[i]) << 16;
    std::memcpy(&v.widened[i], &w, 4);
  }
  return v;
}

// A bfloat16 input: the reference cast of its exact fp32 widening, bit for bit, and (with dbias)
// the widened values' column sums within fp32 rounding.
TEST_P(CudaCastTest, CastTransposeBf16IsTheCastOfTheWidenedValues) {
  GW_REQUIRE_CUDA_DEVICE();
  const auto [format, shape, current] = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> x = RandomNormal(shape.rows * shape.cols, seed, 3.0f);
  const auto [bf16, widened] = Bf16Of(x);
  const float amax = kernels::Amax(widened.data(), int64_t(widened.size()));
  const float delayed_scale = ComputeScale(amax * 0.6f, format, 0);
  const int margin = current ? 1 : 0;
  const CastResult want =
      ReferenceCast(widened, shape.rows, shape.cols, format, current, margin, delayed_scale);
  DeviceBuffer<uint16_t> dx(bf16);
  DeviceCast cast(x.size(), format, current, margin, delayed_scale);
  CastTransposeBf16(dx.get(), shape.rows, shape.cols, cast.out, nullptr);
  ExpectSameCast(cast.Result(), want);
  // With the column sums (a gradient's cast and its bias gradient), as CastTransposeDbias has them.
  DeviceCast cast2(x.size(), format, current, margin, delayed_scale);
  DeviceBuffer<float> dbias(static_cast<size_t>(shape.cols));
  CastTransposeDbiasBf16(dx.get(), shape.rows, shape.cols, cast2.out, dbias.get(), nullptr);
  ExpectSameCast(cast2.Result(), want);
  ExpectColumnSums(dbias.Download(), widened, shape.rows, shape.cols);
}

TEST_P(CudaCastTest, CastTransposeDbias) {
  GW_REQUIRE_CUDA_DEVICE();
  const auto [format, shape, current] = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> x = RandomNormal(shape.rows * shape.cols, seed, 2.0f);
  const float scale = ComputeScale(kernels::Amax(x.data(), int64_t(x.size())), format, 0);
  const CastResult want = ReferenceCast(x, shape.rows, shape.cols, format, current, 0, scale);
  DeviceBuffer<float> dx(x), dbias(static_cast<size_t>(shape.cols));
  DeviceCast cast(x.size(), format, current, 0, scale);
  CastTransposeDbias(dx.get(), shape.rows, shape.cols, cast.out, dbias.get(), nullptr);
  ExpectSameCast(cast.Result(), want);
  ExpectColumnSums(dbias.Download(), x, shape.rows, shape.cols);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaCastTest,
                         ::testing::Combine(::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                                            ::testing::ValuesIn(kShapes), ::testing::Bool()),
                         [](const auto& info) {
                           const Shape s = std::get<1>(info.param);
                           return std::string(Fp8FormatName(std::get<0>(info.param))) + "_" +
                                  std::to_string(s.rows) + "x" + std::to_string(s.cols) +
                                  (std::get<2>(info.param) ? "_current" : "_delayed");
                         });

// NaN, infinities and values past the FP8 range: saturation, NaN codes and a NaN amax as the
// reference has them; current scaling with a NaN amax keeps scale 1.
TEST(CudaCast, SpecialValues) {
  GW_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t rows = 37, cols = 45;
  std::vector<float> x = RandomNormal(rows * cols, seed, 100.0f);
  x[3] = INFINITY;
  x[50] = -INFINITY;
  x[100] = 1e30f;
  x[101] = -1e30f;
  x[200] = -0.0f;
  x[777] = NAN;
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (bool current : {false, true}) {
      const CastResult want = ReferenceCast(x, rows, cols, format, current, 0, 4.0f);
      DeviceBuffer<float> dx(x);
      DeviceCast cast(x.size(), format, current, 0, 4.0f);
      CastTranspose(dx.get(), rows, cols, cast.out, nullptr);
      const CastResult got = cast.Result();
      EXPECT_TRUE(std::isnan(got.amax));
      ExpectSameCast(got, want);
    }
  }
}

TEST(CudaCast, AmaxComputeScaleTransposeDequantize) {
  GW_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t rows = 129, cols = 67, n = rows * cols;
  const std::vector<float> x = RandomNormal(n, seed, 5.0f);
  DeviceBuffer<float> dx(x), amax(1), scale(1), scale_inv(1);
  Amax(dx.get(), n, amax.get(), nullptr);
  ExpectSameBits(amax.Scalar(), kernels::Amax(x.data(), n), "amax");
  ComputeScaleFromAmax(amax.get(), Fp8Format::kE5M2, 2, scale.get(), scale_inv.get(), nullptr);
  const float want_scale = ComputeScale(kernels::Amax(x.data(), n), Fp8Format::kE5M2, 2);
  ExpectSameBits(scale.Scalar(), want_scale, "scale");
  ExpectSameBits(scale_inv.Scalar(), 1.0f / want_scale, "scale_inv");
  std::vector<uint8_t> codes(static_cast<size_t>(n)), codes_t(static_cast<size_t>(n));
  QuantizeFp8(x.data(), rows, cols, want_scale, Fp8Format::kE5M2, codes.data(), nullptr, nullptr);
  kernels::TransposeCodes(codes.data(), rows, cols, codes_t.data());
  DeviceBuffer<uint8_t> dcodes(codes), dcodes_t(static_cast<size_t>(n));
  cuda::TransposeCodes(dcodes.get(), rows, cols, dcodes_t.get(), nullptr);
  EXPECT_EQ(dcodes_t.Download(), codes_t);
  std::vector<float> want(static_cast<size_t>(n));
  DequantizeFp8(codes.data(), n, 1.0f / want_scale, Fp8Format::kE5M2, want.data());
  DeviceBuffer<float> dout(static_cast<size_t>(n));
  Dequantize(dcodes.get(), n, Fp8Format::kE5M2, scale_inv.get(), dout.get(), nullptr);
  const std::vector<float> got = dout.Download();
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(Bits(got[size_t(i)]), Bits(want[size_t(i)])) << i;
}

// |got - want| <= atol + rtol |want| for every element.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double atol,
                 double rtol, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], atol + rtol * std::fabs(want[i])) << what << " element " << i;
  }
}

// The kernel's cast of its own fp32 output y must be the reference cast of y, bit for bit.
void ExpectCastOf(const std::vector<float>& y, int64_t rows, int64_t cols, const DeviceCast& cast,
                  Fp8Format format, bool current) {
  const float delayed = current ? 0.0f : cast.scale.Scalar();
  ExpectSameCast(cast.Result(), ReferenceCast(y, rows, cols, format, current, 0, delayed));
}

class CudaLayerNormTest : public ::testing::TestWithParam<std::tuple<Shape, bool>> {};

// LayerNorm's gamma (around 1) and beta (around 0) for `cols` columns.
std::pair<std::vector<float>, std::vector<float>> LayerNormParamsFor(int64_t cols, uint64_t seed) {
  std::vector<float> gamma = RandomNormal(cols, seed, 0.5f, 1);
  for (float& g : gamma) g += 1.0f;
  return {gamma, RandomNormal(cols, seed, 0.5f, 2)};
}

TEST_P(CudaLayerNormTest, ForwardCastAndBackward) {
  GW_REQUIRE_CUDA_DEVICE();
  const auto [shape, current] = GetParam();
  const int64_t rows = shape.rows, cols = shape.cols, n = rows * cols;
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> x = RandomNormal(n, seed, 2.0f, 0);
  const auto [gamma, beta] = LayerNormParamsFor(cols, seed);
  const float eps = 1e-5f;
  for (bool zero_centered : {false, true}) {
    std::vector<float> y(static_cast<size_t>(n)), mu(static_cast<size_t>(rows)),
        rstd(static_cast<size_t>(rows));
    kernels::LayerNormForward(x.data(), rows, cols, gamma.data(), beta.data(), eps, zero_centered,
                              y.data(), mu.data(), rstd.data());
    DeviceBuffer<float> dx(x), dgamma_in(gamma), dbeta_in(beta), dy(static_cast<size_t>(n)),
        dmu(static_cast<size_t>(rows)), drstd(static_cast<size_t>(rows));
    DeviceCast cast(static_cast<size_t>(n), Fp8Format::kE4M3, current, 0,
                    ComputeScale(kernels::Amax(y.data(), n) * 0.7f, Fp8Format::kE4M3, 0));
    cuda::LayerNormForward(dx.get(), rows, cols, dgamma_in.get(), dbeta_in.get(), eps,
                           zero_centered, dy.get(), &cast.out, dmu.get(), drstd.get(), nullptr);
    const std::vector<float> got_y = dy.Download();
    ExpectClose(dmu.Download(), mu, 1e-5, 1e-5, "mu");
    ExpectClose(drstd.Download(), rstd, 0.0, 1e-5, "rstd");
    ExpectClose(got_y, y, 1e-4, 1e-4, "y");
    ExpectCastOf(got_y, rows, cols, cast, Fp8Format::kE4M3, current);

    // Backward from the same statistics (the reference's), so only the kernel is compared.
    const std::vector<float> grad = RandomNormal(n, seed, 1.0f, 3);
    std::vector<float> dx_ref(static_cast<size_t>(n));
    std::vector<float> dgamma_ref = RandomNormal(cols, seed, 1.0f, 4);
    std::vector<float> dbeta_ref = RandomNormal(cols, seed, 1.0f, 5);
    DeviceBuffer<float> ddgamma(dgamma_ref), ddbeta(dbeta_ref), dgrad(grad), dmu_ref(mu),
        drstd_ref(rstd), ddx(static_cast<size_t>(n));
    kernels::LayerNormBackward(grad.data(), x.data(), mu.data(), rstd.data(), gamma.data(), rows,
                               cols, zero_centered, dx_ref.data(), dgamma_ref.data(),
                               dbeta_ref.data());
    cuda::LayerNormBackward(dgrad.get(), dx.get(), dmu_ref.get(), drstd_ref.get(), dgamma_in.get(),
                            rows, cols, zero_centered, ddx.get(), ddgamma.get(), ddbeta.get(),
                            nullptr);
    ExpectClose(ddx.Download(), dx_ref, 1e-4, 1e-3, "dx");
    // Column sums in different orders (and chunks): each within (rows + 1) 2^-24 of the sum of
    // |terms| (the initial value included); twice that between the two, with room for a fused
    // multiply-add in dy * xhat.
    const std::vector<float> got_dgamma = ddgamma.Download(), got_dbeta = ddbeta.Download();
    for (int64_t c = 0; c < cols; ++c) {
      double abs_g = std::fabs(dgamma_ref[size_t(c)]), abs_b = std::fabs(dbeta_ref[size_t(c)]);
      for (int64_t r = 0; r < rows; ++r) {
        const double d = grad[size_t(r * cols + c)];
        abs_g += std::fabs(d * (double(x[size_t(r * cols + c)]) - mu[size_t(r)]) * rstd[size_t(r)]);
        abs_b += std::fabs(d);
      }
      const double u = 4.0 * double(rows + 2) * std::ldexp(1.0, -24);
      ASSERT_NEAR(got_dgamma[size_t(c)], dgamma_ref[size_t(c)], u * abs_g + 1e-30)
          << "dgamma " << c;
      ASSERT_NEAR(got_dbeta[size_t(c)], dbeta_ref[size_t(c)], u * abs_b + 1e-30) << "dbeta " << c;
    }
  }
}

// A bfloat16 x: the float32 kernels' results on its exact widening, bit for bit (the same code
// reads both); the parameter gradients' atomics add in an order that varies, so they are within
// fp32 rounding of each other.
TEST_P(CudaLayerNormTest, Bf16IsTheFloat32FormOnTheWidenedValues) {
  GW_REQUIRE_CUDA_DEVICE();
  const auto [shape, current] = GetParam();
  const int64_t rows = shape.rows, cols = shape.cols, n = rows * cols;
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto [bf16, widened] = Bf16Of(RandomNormal(n, seed, 2.0f, 0));
  const auto [gamma, beta] = LayerNormParamsFor(cols, seed);
  const float eps = 1e-5f;
  for (bool zero_centered : {false, true}) {
    DeviceBuffer<float> dwide(widened), dgamma_in(gamma), dbeta_in(beta);
    DeviceBuffer<uint16_t> dbf16(bf16);
    const float scale = ComputeScale(8.0f, Fp8Format::kE4M3, 0);
    DeviceBuffer<float> y32(static_cast<size_t>(n)), mu32(static_cast<size_t>(rows)),
        rstd32(static_cast<size_t>(rows)), y16(static_cast<size_t>(n)),
        mu16(static_cast<size_t>(rows)), rstd16(static_cast<size_t>(rows));
    DeviceCast cast32(static_cast<size_t>(n), Fp8Format::kE4M3, current, 0, scale),
        cast16(static_cast<size_t>(n), Fp8Format::kE4M3, current, 0, scale);
    cuda::LayerNormForward(dwide.get(), rows, cols, dgamma_in.get(), dbeta_in.get(), eps,
                           zero_centered, y32.get(), &cast32.out, mu32.get(), rstd32.get(),
                           nullptr);
    cuda::LayerNormForwardBf16(dbf16.get(), rows, cols, dgamma_in.get(), dbeta_in.get(), eps,
                               zero_centered, y16.get(), &cast16.out, mu16.get(), rstd16.get(),
                               nullptr);
    EXPECT_EQ(y16.Download(), y32.Download());
    EXPECT_EQ(mu16.Download(), mu32.Download());
    EXPECT_EQ(rstd16.Download(), rstd32.Download());
    ExpectSameCast(cast16.Result(), cast32.Result());

    const std::vector<float> grad = RandomNormal(n, seed, 1.0f, 3);
    const std::vector<float> start_g = RandomNormal(cols, seed, 1.0f, 4),
                             start_b = RandomNormal(cols, seed, 1.0f, 5);
    DeviceBuffer<float> dgrad(grad), dx32(static_cast<size_t>(n)), dx16(static_cast<size_t>(n)),
        g32(start_g), b32(start_b), g16(start_g), b16(start_b);
    cuda::LayerNormBackward(dgrad.get(), dwide.get(), mu32.get(), rstd32.get(), dgamma_in.get(),
                            rows, cols, zero_centered, dx32.get(), g32.get(), b32.get(), nullptr);
    cuda::LayerNormBackwardBf16(dgrad.get(), dbf16.get(), mu32.get(), rstd32.get(), dgamma_in.get(),
                                rows, cols, zero_centered, dx16.get(), g16.get(), b16.get(),
                                nullptr);
    EXPECT_EQ(dx16.Download(), dx32.Download());
    ExpectClose(g16.Download(), g32.Download(), 1e-5, 1e-5, "dgamma");
    ExpectClose(b16.Download(), b32.Download(), 1e-5, 1e-5, "dbeta");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLayerNormTest,
                         ::testing::Combine(::testing::Values(Shape{1, 16}, Shape{7, 61},
                                                              Shape{130, 1031}, Shape{512, 4096}),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           const Shape s = std::get<0>(info.param);
                           return std::to_string(s.rows) + "x" + std::to_string(s.cols) +
                                  (std::get<1>(info.param) ? "_current" : "_delayed");
                         });

class CudaActivationTest : public ::testing::TestWithParam<std::tuple<Activation, bool>> {};

TEST_P(CudaActivationTest, ForwardAndBackwardWithCasts) {
  GW_REQUIRE_CUDA_DEVICE();
  const auto [act, current] = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (Shape shape : {Shape{1, 1}, Shape{33, 47}, Shape{300, 1031}}) {
    const int64_t rows = shape.rows, width = shape.cols;
    const int64_t in_width = IsGated(act) ? 2 * width : width;
    const std::vector<float> in = RandomNormal(rows * in_width, seed, 2.0f, 0);
    std::vector<float> y(static_cast<size_t>(rows * width));
    kernels::ActivationForward(act, in.data(), rows, width, y.data());
    DeviceBuffer<float> din(in), dy(y.size());
    DeviceCast cast(y.size(), Fp8Format::kE4M3, current, 0,
                    ComputeScale(kernels::Amax(y.data(), int64_t(y.size())), Fp8Format::kE4M3, 0));
    cuda::ActivationForward(act, din.get(), rows, width, dy.get(), &cast.out, nullptr);
    const std::vector<float> got_y = dy.Download();
    ExpectClose(got_y, y, 1e-6, 1e-5, "activation");
    ExpectCastOf(got_y, rows, width, cast, Fp8Format::kE4M3, current);

    const std::vector<float> dout = RandomNormal(rows * width, seed, 1.0f, 1);
    std::vector<float> dgrad(in.size());
    kernels::ActivationBackward(act, dout.data(), in.data(), rows, width, dgrad.data());
    DeviceBuffer<float> ddout(dout), dgrad_dev(in.size()), dbias(static_cast<size_t>(in_width));
    DeviceCast gcast(
        in.size(), Fp8Format::kE5M2, current, 0,
        ComputeScale(kernels::Amax(dgrad.data(), int64_t(dgrad.size())), Fp8Format::kE5M2, 0));
    DActivationDbiasCast(act, ddout.get(), din.get(), rows, width, dgrad_dev.get(), &gcast.out,
                         dbias.get(), nullptr);
    const std::vector<float> got_g = dgrad_dev.Download();
    // The device's tanhf/expf and contracted multiply-adds round differently from the host's, and
    // the derivative's terms can cancel: the bound scales with the terms' magnitude,
    // |dout * gate| (1 + a^2), not with the result (measured on an H100: 1.9e-6 against a
    // result of 0.015 for geglu, where |dout * gate| is about 2).
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < in_width; ++j) {
        const int64_t c = j % width;
        const double a = in[size_t(r * in_width + c)];
        const double gate = IsGated(act) ? std::fabs(in[size_t(r * in_width + width + c)]) : 1.0;
        const double terms = std::fabs(dout[size_t(r * width + c)]) * gate * (1.0 + a * a);
        const size_t i = size_t(r * in_width + j);
        ASSERT_NEAR(got_g[i], dgrad[i], 1e-6 * (1.0 + terms) + 1e-5 * std::fabs(dgrad[i]))
            << "d activation element " << i;
      }
    }
    ExpectCastOf(got_g, rows, in_width, gcast, Fp8Format::kE5M2, current);
    std::vector<float> sums(static_cast<size_t>(in_width));
    ColumnSums(got_g.data(), rows, in_width, sums.data());
    // Two fp32 summation orders: each within (rows - 1) 2^-24 sum |x| of the exact column sum.
    const std::vector<float> got_db = dbias.Download();
    for (int64_t c = 0; c < in_width; ++c) {
      double abs_sum = 0;
      for (int64_t r = 0; r < rows; ++r) abs_sum += std::fabs(got_g[size_t(r * in_width + c)]);
      ASSERT_NEAR(got_db[size_t(c)], sums[size_t(c)],
                  2.0 * double(rows) * std::ldexp(1.0, -24) * abs_sum + 1e-30)
          << "dbias column " << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, CudaActivationTest,
                         ::testing::Combine(::testing::Values(Activation::kGelu, Activation::kRelu,
                                                              Activation::kSwiglu,
                                                              Activation::kGeglu),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(ActivationName(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_current" : "_delayed");
                         });

}  // namespace
}  // namespace gradwire::kernels::cuda
