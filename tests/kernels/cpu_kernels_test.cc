// The CPU backend's loops (kernels/cpu) against the reference loops they stand for (kernels/ref):
// the same bits, on fresh random inputs with NaN, inf and size-1/prime shapes; and the pool that
// runs them.
#include <gtest/gtest.h>

#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cast_copies.h"
#include "gradwire/kernels/cpu/cast.h"
#include "gradwire/kernels/cpu/layernorm.h"
#include "gradwire/kernels/cpu/loops.h"
#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/cpu/scratch.h"
#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/activation.h"
#include "gradwire/kernels/ref/cast.h"
#include "gradwire/kernels/ref/layernorm.h"

namespace gradwire::kernels {
namespace {

std::mt19937& Rng() {
  thread_local std::mt19937 rng(std::random_device{}());
  return rng;
}

std::vector<float> RandomNormal(int64_t n, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(Rng());
  return v;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

bool SameBits(float a, float b) { return Bits(a) == Bits(b) || (std::isnan(a) && std::isnan(b)); }

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

// Every float from 2^-26 up to 2^18 (past both formats' largest values and below half their
// smallest subnormals), both signs: the encoder's whole rounding range, exhaustively.
TEST(CpuCastTest, EncodeMatchesTheReferenceOnEveryFloatOfTheFp8Range) {
  constexpr uint32_t kChunk = 1u << 20;
  std::vector<float> x(kChunk);
  std::vector<uint8_t> got(kChunk);
  ForEachCastCopy([&] {
    for (Fp8Format format : kFormats) {
      int64_t mismatches = 0;
      for (uint32_t base = uint32_t(127 - 26) << 23; base < uint32_t(127 + 18) << 23;
           base += kChunk) {
        for (uint32_t i = 0; i < kChunk; ++i) x[i] = FromBits((base + i) | ((i & 1u) << 31));
        cpu::EncodeFp8(x.data(), kChunk, 1.0f, format, got.data());
        for (uint32_t i = 0; i < kChunk; ++i) {
          if (got[i] != EncodeFp8(x[i], format) && mismatches++ < 5) {
            ADD_FAILURE() << Fp8FormatName(format) << " " << x[i] << ": got " << int(got[i])
                          << ", reference " << int(EncodeFp8(x[i], format));
          }
        }
      }
      EXPECT_EQ(mismatches, 0) << Fp8FormatName(format);
    }
  });
}

// Random bit patterns of every kind (NaNs, infinities, float subnormals, huge values) and the
// edges, each scaled: scale * x rounds before the encode, as in the reference.
TEST(CpuCastTest, EncodeMatchesTheReferenceOnRandomBitPatternsAndEdges) {
  std::vector<float> x = {0.0f,
                          -0.0f,
                          INFINITY,
                          -INFINITY,
                          NAN,
                          -NAN,
                          1e-45f,
                          -1e-45f,
                          FLT_MIN,
                          3.4e38f,
                          448.0f,
                          464.0f,
                          463.99f,
                          480.0f,
                          57344.0f,
                          61440.0f,
                          61439.0f,
                          65536.0f,
                          0.015625f,
                          0.0078125f,
                          1.52587890625e-05f,
                          7.62939453125e-06f};
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 1 << 20; ++i) x.push_back(FromBits(bits(Rng())));
  std::vector<uint8_t> got(x.size());
  ForEachCastCopy([&] {
    for (Fp8Format format : kFormats) {
      for (float scale : {1.0f, 0.37f, 1234.5f, 3.0e30f}) {
        cpu::EncodeFp8(x.data(), int64_t(x.size()), scale, format, got.data());
        for (size_t i = 0; i < x.size(); ++i) {
          ASSERT_EQ(got[i], EncodeFp8(x[i] * scale, format))
              << Fp8FormatName(format) << " x " << x[i] << " scale " << scale;
        }
      }
    }
  });
}

class CpuQuantizeTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(CpuQuantizeTest, CodesTransposeAndAmaxMatchTheReference) {
  const auto [rows, cols] = GetParam();
  ForEachCastCopy([&, rows = rows, cols = cols] {
    for (Fp8Format format : kFormats) {
      for (int poison : {0, 1, 2}) {  // none, an inf, a NaN
        std::vector<float> x = RandomNormal(rows * cols, 3.0f);
        const size_t at = size_t(rows * cols) / 2;
        if (poison == 1) x[at] = -INFINITY;
        if (poison == 2) x[at] = NAN;
        const float scale = 17.25f;
        std::vector<uint8_t> want(x.size()), want_t(x.size());
        float want_amax = -1.0f;
        QuantizeFp8(x.data(), rows, cols, scale, format, want.data(), want_t.data(), &want_amax);
        // Every combination of copies; outputs poisoned first.
        for (int mask = 1; mask < 4; ++mask) {
          std::vector<uint8_t> got(x.size(), 0xA5), got_t(x.size(), 0x5A);
          float amax = -1.0f;
          cpu::QuantizeFp8(x.data(), rows, cols, scale, format, mask & 1 ? got.data() : nullptr,
                           mask & 2 ? got_t.data() : nullptr, &amax);
          if (mask & 1) {
            EXPECT_EQ(got, want) << rows << "x" << cols << " mask " << mask;
          }
          if (mask & 2) {
            EXPECT_EQ(got_t, want_t) << rows << "x" << cols << " mask " << mask;
          }
          EXPECT_TRUE(SameBits(amax, want_amax)) << amax << " vs " << want_amax;
        }
        std::vector<uint8_t> transposed(x.size(), 0);
        cpu::TransposeCodes(want.data(), rows, cols, transposed.data());
        EXPECT_EQ(transposed, want_t);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuQuantizeTest,
                         ::testing::Values(std::make_tuple(1, 1), std::make_tuple(1, 97),
                                           std::make_tuple(97, 1), std::make_tuple(63, 65),
                                           std::make_tuple(130, 7), std::make_tuple(257, 300),
                                           std::make_tuple(1024, 512), std::make_tuple(48, 80),
                                           std::make_tuple(200, 1024)));

TEST(CpuLoopsTest, AbsMaxAndAddAbsMaxMatchTheReferenceWithNaNAndInf) {
  for (int64_t n : {0, 1, 7, 1000, 65536 + 13, 1 << 19}) {
    for (int poison : {0, 1, 2, 3}) {  // none, +inf, NaN, NaN and -inf
      std::vector<float> a = RandomNormal(n), b = RandomNormal(n);
      if (n > 0 && poison == 1) a[size_t(n) - 1] = INFINITY;
      if (n > 0 && poison >= 2) a[size_t(n) / 3] = NAN;
      if (n > 1 && poison == 3) a[1] = -INFINITY;
      EXPECT_TRUE(SameBits(cpu::AbsMax(a.data(), n), Amax(a.data(), n))) << n << " " << poison;
      std::vector<float> want(static_cast<size_t>(n)), got(size_t(n), 123.0f);
      for (int64_t i = 0; i < n; ++i) want[size_t(i)] = a[size_t(i)] + b[size_t(i)];
      const float amax = cpu::AddAbsMax(a.data(), b.data(), got.data(), n);
      EXPECT_TRUE(SameBits(amax, Amax(want.data(), n))) << n << " " << poison;
      for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(SameBits(got[size_t(i)], want[size_t(i)]));
      // In place, as the gradient accumulators use it.
      cpu::AddAbsMax(a.data(), b.data(), a.data(), n);
      for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(SameBits(a[size_t(i)], want[size_t(i)]));
    }
  }
}

TEST(CpuLoopsTest, AddColumnSumsIsTheReferenceColumnSumThenAnAdd) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {5, 300}, {300, 5}, {257, 1031}}) {
    const std::vector<float> x = RandomNormal(rows * cols, 100.0f);
    std::vector<float> acc = RandomNormal(cols), want = acc, sums(static_cast<size_t>(cols));
    ColumnSums(x.data(), rows, cols, sums.data());
    for (int64_t c = 0; c < cols; ++c) want[size_t(c)] += sums[size_t(c)];
    cpu::AddColumnSums(x.data(), rows, cols, acc.data());
    for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(Bits(acc[size_t(c)]), Bits(want[size_t(c)]));
  }
}

TEST(CpuLoopsTest, DecodeAndFillRows) {
  for (Fp8Format format : kFormats) {
    std::vector<uint8_t> codes(70001);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t(Rng()());
    std::vector<float> out(codes.size());
    cpu::DecodeCodes(codes.data(), int64_t(codes.size()), format, out.data());
    for (size_t i = 0; i < codes.size(); ++i) {
      ASSERT_TRUE(SameBits(out[i], DecodeFp8(codes[i], format)));
    }
  }
  const std::vector<float> row = RandomNormal(37);
  std::vector<float> out(37 * 2001, 0.0f);
  cpu::FillRows(row.data(), 2001, 37, out.data());
  for (int64_t r = 0; r < 2001; ++r) {
    ASSERT_EQ(std::memcmp(out.data() + r * 37, row.data(), 37 * sizeof(float)), 0) << r;
  }
}

TEST(CpuLayerNormTest, ForwardAndBackwardMatchTheReferenceBitForBit) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {129, 64}, {600, 300}}) {
    for (bool zero_centered : {false, true}) {
      const std::vector<float> x = RandomNormal(rows * cols, 2.0f), gamma = RandomNormal(cols),
                               beta = RandomNormal(cols), dy = RandomNormal(rows * cols);
      std::vector<float> y(x.size()), mu(static_cast<size_t>(rows)),
          rstd(static_cast<size_t>(rows)), y2(x.size(), 9.0f), mu2(size_t(rows), 9.0f),
          rstd2(size_t(rows), 9.0f);
      LayerNormForward(x.data(), rows, cols, gamma.data(), beta.data(), 1e-5f, zero_centered,
                       y.data(), mu.data(), rstd.data());
      cpu::LayerNormForward(x.data(), rows, cols, gamma.data(), beta.data(), 1e-5f, zero_centered,
                            y2.data(), mu2.data(), rstd2.data());
      ASSERT_EQ(std::memcmp(y.data(), y2.data(), y.size() * 4), 0);
      ASSERT_EQ(std::memcmp(mu.data(), mu2.data(), mu.size() * 4), 0);
      ASSERT_EQ(std::memcmp(rstd.data(), rstd2.data(), rstd.size() * 4), 0);
      // Accumulating into non-zero gamma and beta gradients.
      std::vector<float> dx(x.size()), dg = RandomNormal(cols), db = RandomNormal(cols);
      std::vector<float> dx2(x.size(), 9.0f), dg2 = dg, db2 = db;
      LayerNormBackward(dy.data(), x.data(), mu.data(), rstd.data(), gamma.data(), rows, cols,
                        zero_centered, dx.data(), dg.data(), db.data());
      cpu::LayerNormBackward(dy.data(), x.data(), mu.data(), rstd.data(), gamma.data(), rows, cols,
                             zero_centered, dx2.data(), dg2.data(), db2.data());
      ASSERT_EQ(std::memcmp(dx.data(), dx2.data(), dx.size() * 4), 0) << rows << "x" << cols;
      ASSERT_EQ(std::memcmp(dg.data(), dg2.data(), dg.size() * 4), 0) << rows << "x" << cols;
      ASSERT_EQ(std::memcmp(db.data(), db2.data(), db.size() * 4), 0) << rows << "x" << cols;
    }
  }
}

TEST(CpuActivationTest, ForwardAndBackwardMatchTheReferenceBitForBit) {
  for (Activation act :
       {Activation::kGelu, Activation::kRelu, Activation::kSwiglu, Activation::kGeglu}) {
    const int64_t rows = 301, width = 129, in_width = IsGated(act) ? 2 * width : width;
    const std::vector<float> in = RandomNormal(rows * in_width, 3.0f),
                             dout = RandomNormal(rows * width);
    std::vector<float> out(static_cast<size_t>(rows * width)), out2(out.size(), 9.0f);
    ActivationForward(act, in.data(), rows, width, out.data());
    cpu::ActivationForward(act, in.data(), rows, width, out2.data());
    ASSERT_EQ(std::memcmp(out.data(), out2.data(), out.size() * 4), 0) << ActivationName(act);
    std::vector<float> din(in.size()), din2(in.size(), 9.0f);
    ActivationBackward(act, dout.data(), in.data(), rows, width, din.data());
    cpu::ActivationBackward(act, dout.data(), in.data(), rows, width, din2.data());
    ASSERT_EQ(std::memcmp(din.data(), din2.data(), din.size() * 4), 0) << ActivationName(act);
  }
}

// A NaN stays a NaN through every activation and its derivative (and, in the sanitizer builds,
// reaches no undefined conversion on the way); an infinite input gives a non-finite output.
TEST(CpuActivationTest, NaNAndInfinityStayNonFinite) {
  for (Activation act :
       {Activation::kGelu, Activation::kRelu, Activation::kSwiglu, Activation::kGeglu}) {
    const int64_t width = 4, in_width = IsGated(act) ? 2 * width : width;
    std::vector<float> in(size_t(in_width), 1.0f);
    in[0] = NAN;
    in[1] = INFINITY;
    std::vector<float> out(static_cast<size_t>(width)), din(static_cast<size_t>(in_width));
    const std::vector<float> dout(size_t(width), 1.0f);
    ActivationForward(act, in.data(), 1, width, out.data());
    ActivationBackward(act, dout.data(), in.data(), 1, width, din.data());
    EXPECT_TRUE(std::isnan(out[0])) << ActivationName(act);
    EXPECT_TRUE(std::isnan(din[0])) << ActivationName(act);
    EXPECT_FALSE(std::isfinite(out[1])) << ActivationName(act);
    EXPECT_TRUE(std::isfinite(out[2])) << ActivationName(act);
  }
}

TEST(CpuParallelTest, EveryIndexRunsOnceInContiguousRanges) {
  for (int64_t n : {0, 1, 5, 1000, 1 << 20}) {
    for (int64_t grain : {1, 7, 1 << 12}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      std::atomic<int64_t> ranges{0};
      const int64_t expected = cpu::Ranges(n, grain);
      cpu::ParallelForRanges(n, grain, [&](int64_t range, int64_t b, int64_t e) {
        EXPECT_LT(range, expected);
        EXPECT_LE(b, e);
        ranges.fetch_add(1);
        for (int64_t i = b; i < e; ++i) hits[size_t(i)].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << n << " " << i;
      EXPECT_EQ(ranges.load(), expected);
    }
  }
}

TEST(CpuParallelTest, NestedAndConcurrentCallsFinishAndExceptionsReachTheCaller) {
  cpu::SetThreads(3);  // more workers than this machine may have cores: still correct
  std::atomic<int64_t> sum{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&] {
      for (int rep = 0; rep < 50; ++rep) {
        cpu::ParallelFor(64, 1, [&](int64_t b, int64_t e) {
          // A nested call runs serially on this thread.
          cpu::ParallelFor(e - b, 1, [&](int64_t nb, int64_t ne) { sum.fetch_add(ne - nb); });
        });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4 * 50 * 64);
  EXPECT_THROW(cpu::ParallelFor(1000, 1,
                                [](int64_t b, int64_t) {
                                  if (b > 0) throw std::runtime_error("range failed");
                                }),
               std::runtime_error);
  // The pool still works after a failed job.
  std::atomic<int64_t> after{0};
  cpu::ParallelFor(1000, 1, [&](int64_t b, int64_t e) { after.fetch_add(e - b); });
  EXPECT_EQ(after.load(), 1000);
  cpu::SetThreads(0);
}

TEST(CpuScratchTest, BuffersAreReusedAndReleased) {
  cpu::ReleaseScratch();
  void* first = nullptr;
  {
    cpu::Scratch s = cpu::TakeScratch(size_t(3) << 20);
    first = s.data();
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    std::memset(s.data(), 1, s.bytes());  // writable over its whole size
  }
  const cpu::ScratchStats after_one = cpu::GetScratchStats();
  EXPECT_GE(after_one.free_bytes, int64_t(3) << 20);
  {
    cpu::Scratch again = cpu::TakeScratch(size_t(2) << 20);  // fits the freed buffer
    EXPECT_EQ(again.data(), first);
    cpu::Scratch other = cpu::TakeScratch(size_t(2) << 20);  // the first one is leased
    EXPECT_NE(other.data(), first);
  }
  const cpu::ScratchStats two = cpu::GetScratchStats();
  EXPECT_EQ(two.allocations, after_one.allocations + 1);
  EXPECT_EQ(two.leased_bytes, 0);
  cpu::ReleaseScratch();
  EXPECT_EQ(cpu::GetScratchStats().free_bytes, 0);
}

}  // namespace
}  // namespace gradwire::kernels
