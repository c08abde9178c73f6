// The parts of the CUDA backend that run without a GPU, so CI checks them on every build: the
// element arithmetic the kernels share with the host (fp8_math.h) against the reference backend,
// the argument checks that run before any launch, and the GEMM plan-cache key.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <unordered_set>

#include "fp8_math.h"
#include "gradwire/kernels/cuda/activation.h"
#include "gradwire/kernels/cuda/cast.h"
#include "gradwire/kernels/cuda/gemm_lt.h"
#include "gradwire/kernels/cuda/recipe.h"
#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/cast.h"

namespace gradwire::kernels::cuda {
namespace {

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Every float whose low 12 mantissa bits follow a pattern that covers both halves of every FP8
// rounding interval (ties included: the bits just below the FP8 mantissa are all enumerated), for
// every sign and exponent: 2^20 x 3 patterns per format, against EncodeFp8.
TEST(CudaFp8Math, EncoderMatchesReferenceOverFloatSweep) {
  for (Fp8Format format : kFormats) {
    int64_t mismatches = 0;
    for (uint32_t high = 0; high < (1u << 20); ++high) {
      for (uint32_t low : {0x000u, 0x800u, 0xFFFu}) {
        const float v = FromBits((high << 12) | low);
        if (EncodeFp8HD(v, format) != EncodeFp8(v, format)) ++mismatches;
      }
    }
    EXPECT_EQ(mismatches, 0) << Fp8FormatName(format);
  }
}

TEST(CudaFp8Math, EncoderMatchesReferenceOnRandomAndEdgeValues) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<float> values = {0.0f,
                               -0.0f,
                               INFINITY,
                               -INFINITY,
                               NAN,
                               -NAN,
                               FLT_MAX,
                               -FLT_MAX,
                               FLT_MIN,
                               FLT_TRUE_MIN,
                               448.0f,
                               464.0f,
                               480.0f,
                               57344.0f,
                               61440.0f,
                               std::ldexp(1.0f, -9),
                               std::ldexp(1.5f, -10),
                               std::ldexp(1.0f, -16),
                               std::ldexp(1.5f, -17),
                               std::ldexp(1.0f, -18)};
  for (int i = 0; i < 2000000; ++i) values.push_back(FromBits(uint32_t(rng())));
  for (Fp8Format format : kFormats) {
    for (float v : values) {
      ASSERT_EQ(EncodeFp8HD(v, format), EncodeFp8(v, format))
          << Fp8FormatName(format) << " value " << v;
    }
  }
}

TEST(CudaFp8Math, ComputeScaleMatchesReference) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<float> amaxes = {0.0f,   -0.0f,   INFINITY, NAN,    FLT_TRUE_MIN, FLT_MIN,
                               1e-30f, FLT_MAX, 1.0f,     448.0f, 57344.0f};
  for (int i = 0; i < 200000; ++i) amaxes.push_back(std::fabs(FromBits(uint32_t(rng()))));
  for (Fp8Format format : kFormats) {
    for (int margin : {-3, 0, 1, 4}) {
      for (float a : amaxes) {
        const float got = ComputeScaleHD(a, format, margin);
        const float want = ComputeScale(a, format, margin);
        ASSERT_EQ(std::memcmp(&got, &want, sizeof got), 0)
            << "amax " << a << " margin " << margin << ": " << got << " vs " << want;
      }
    }
  }
}

// The kernels reduce amax as unsigned bits; the order must be the float order and NaN must come
// out as the reference's NaN.
TEST(CudaFp8Math, AmaxBitsOrderAndNan) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1e6f, 1e6f);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> x(1 + rng() % 300);
    for (float& v : x) v = dist(rng) * std::ldexp(1.0f, int(rng() % 60) - 30);
    if (trial % 3 == 0) x[rng() % x.size()] = -INFINITY;
    if (trial % 5 == 0) x[rng() % x.size()] = -NAN;
    uint32_t bits = 0;
    for (float v : x) bits = std::max(bits, AmaxBitsHD(v));
    const float got = FromBits(bits), want = kernels::Amax(x.data(), int64_t(x.size()));
    ASSERT_EQ(std::memcmp(&got, &want, sizeof got), 0) << got << " vs " << want;
  }
  EXPECT_EQ(AmaxBitsHD(-0.0f), 0u);
  EXPECT_TRUE(IsNanHD(NanMaxHD(1.0f, NAN)));
  EXPECT_TRUE(IsNanHD(NanMaxHD(NAN, 1.0f)));
  EXPECT_EQ(NanMaxHD(2.0f, 1.0f), 2.0f);
  EXPECT_EQ(NanMaxHD(1.0f, 2.0f), 2.0f);
}

LtGemmArgs ValidGemm() {
  alignas(16) static uint8_t fake[64];  // host memory: only the checks run
  alignas(16) static float scale = 1.0f;
  LtGemmArgs args;
  args.a = fake;
  args.b = fake;
  args.d = fake;
  args.a_scale_inv = &scale;
  args.b_scale_inv = &scale;
  args.m = 32;
  args.n = 48;
  args.k = 64;
  return args;
}

TEST(CudaGemmLt, ValidationAcceptsMultiplesOf16) {
  EXPECT_EQ(ValidateLtGemm(ValidGemm()), "");
  LtGemmArgs args = ValidGemm();
  args.a_format = Fp8Format::kE5M2;  // dgrad/wgrad pairing
  EXPECT_EQ(ValidateLtGemm(args), "");
}

// A non-multiple of 16 is rejected with the documented error, before any device work (this runs
// without a GPU: the call would otherwise fail on cudaGetDevice).
TEST(CudaGemmLt, NonMultipleOf16IsRejected) {
  for (const char* dim : {"m", "n", "k"}) {
    for (int64_t bad : {int64_t(17), int64_t(8), int64_t(0), int64_t(-16), int64_t(4099)}) {
      LtGemmArgs args = ValidGemm();
      (dim[0] == 'm' ? args.m : dim[0] == 'n' ? args.n : args.k) = bad;
      const std::string why = ValidateLtGemm(args);
      EXPECT_NE(why.find(std::string(dim) + "=" + std::to_string(bad)), std::string::npos) << why;
      EXPECT_NE(why.find("multiple of 16"), std::string::npos) << why;
      try {
        Fp8GemmLt(args);
        ADD_FAILURE() << "Fp8GemmLt accepted " << dim << "=" << bad;
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()), why);
      }
    }
  }
}

TEST(CudaGemmLt, OtherBadArgumentsAreRejected) {
  LtGemmArgs args = ValidGemm();
  args.a_format = args.b_format = Fp8Format::kE5M2;
  EXPECT_NE(ValidateLtGemm(args).find("E5M2 x E5M2"), std::string::npos);
  args = ValidGemm();
  args.b = nullptr;
  EXPECT_NE(ValidateLtGemm(args).find("must not be null"), std::string::npos);
  args = ValidGemm();
  args.a = reinterpret_cast<const uint8_t*>(ValidGemm().a) + 1;
  EXPECT_NE(ValidateLtGemm(args).find("16-byte aligned"), std::string::npos);
  args = ValidGemm();
  args.b_scale_inv = reinterpret_cast<const float*>(ValidGemm().a) + 1;
  EXPECT_NE(ValidateLtGemm(args).find("scale_inv must be 16-byte aligned"), std::string::npos);
  EXPECT_THROW(Fp8GemmLt(args), std::invalid_argument);
  args = ValidGemm();
  args.epilogue = GemmEpilogue::kBias;
  EXPECT_NE(ValidateLtGemm(args).find("needs a 16-byte aligned bf16 bias"), std::string::npos);
  EXPECT_THROW(Fp8GemmLt(args), std::invalid_argument);
  args = ValidGemm();
  args.bias = static_cast<const uint16_t*>(args.d);
  EXPECT_NE(ValidateLtGemm(args).find("without the bias epilogue"), std::string::npos);
  EXPECT_THROW(Fp8GemmLt(args), std::invalid_argument);
}

// Every field of the key separates plans; equal arguments give equal keys and hashes.
TEST(CudaGemmLt, PlanKeySeparatesEveryField) {
  const LtPlanKey base = PlanKeyOf(ValidGemm(), 0);
  EXPECT_EQ(base, PlanKeyOf(ValidGemm(), 0));
  EXPECT_EQ(LtPlanKeyHash()(base), LtPlanKeyHash()(PlanKeyOf(ValidGemm(), 0)));
  std::vector<LtPlanKey> variants;
  auto vary = [&](auto change) {
    LtGemmArgs args = ValidGemm();
    int device = 0;
    change(args, device);
    variants.push_back(PlanKeyOf(args, device));
  };
  vary([](LtGemmArgs& a, int&) { a.m = 48; });
  vary([](LtGemmArgs& a, int&) { a.n = 32; });
  vary([](LtGemmArgs& a, int&) { a.k = 32; });
  vary([](LtGemmArgs& a, int&) { a.a_format = Fp8Format::kE5M2; });
  vary([](LtGemmArgs& a, int&) { a.b_format = Fp8Format::kE5M2; });
  vary([](LtGemmArgs& a, int&) { a.d_type = GemmOut::kBFloat16; });
  vary([](LtGemmArgs& a, int&) { a.epilogue = GemmEpilogue::kBias; });
  vary([](LtGemmArgs& a, int&) { a.accumulation = GemmAccumulation::kSplit; });
  vary([](LtGemmArgs& a, int&) { a.accumulate = true; });
  vary([](LtGemmArgs&, int& device) { device = 1; });
  std::unordered_set<size_t> hashes = {LtPlanKeyHash()(base)};
  for (size_t i = 0; i < variants.size(); ++i) {
    EXPECT_FALSE(variants[i] == base) << "variant " << i;
    for (size_t j = 0; j < i; ++j) EXPECT_FALSE(variants[i] == variants[j]) << i << " " << j;
    hashes.insert(LtPlanKeyHash()(variants[i]));
  }
  EXPECT_EQ(hashes.size(), variants.size() + 1) << "hash collision among the variants";
  // The pointers are not part of the key: a plan serves every buffer of its shape.
  LtGemmArgs other = ValidGemm();
  alignas(16) static uint8_t elsewhere[64];
  other.a = elsewhere;
  other.b = elsewhere;
  other.d = elsewhere;
  EXPECT_EQ(PlanKeyOf(other, 0), base);
}

// The kernels' argument checks run before any launch, so they are testable here.
TEST(CudaKernelArgs, BadArgumentsThrowBeforeLaunch) {
  float scale = 1.0f;
  Fp8Output out;
  out.scale = &scale;
  EXPECT_THROW(CastTranspose(nullptr, -1, 4, out, nullptr), std::invalid_argument);
  EXPECT_THROW(CastTranspose(nullptr, int64_t(65536) * 32, 4, out, nullptr), std::invalid_argument);
  Fp8Output no_scale;
  EXPECT_THROW(CastTranspose(nullptr, 4, 4, no_scale, nullptr), std::invalid_argument);
  Fp8Output current = out;
  current.current = true;  // without amax
  EXPECT_THROW(CastTranspose(nullptr, 4, 4, current, nullptr), std::invalid_argument);
  EXPECT_THROW(CastTransposeDbias(nullptr, 4, 4, out, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(ActivationForward(Activation(9), nullptr, 4, 4, nullptr, &out, nullptr),
               std::invalid_argument);
  EXPECT_THROW(DelayedScalingRoll(nullptr, nullptr, nullptr, 1, 0, Fp8Format::kE4M3, 0,
                                  AmaxAlgo::kMax, nullptr, nullptr, nullptr),
               std::invalid_argument);
  EXPECT_THROW(DelayedScalingRoll(nullptr, nullptr, nullptr, 1, 8193, Fp8Format::kE4M3, 0,
                                  AmaxAlgo::kMax, nullptr, nullptr, nullptr),
               std::invalid_argument);
}

}  // namespace
}  // namespace gradwire::kernels::cuda
