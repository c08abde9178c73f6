// Fresh random inputs for the kernel tests: normal floats, and FP8 codes of finite values (a
// random tensor cast at its own current scale).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/cast.h"

namespace gradwire::kernels::test_data {

inline std::mt19937& Rng() {
  thread_local std::mt19937 rng(std::random_device{}());
  return rng;
}

inline std::vector<float> RandomNormal(int64_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(Rng());
  return v;
}

// `n` codes in `format` and the scale_inv that decodes them.
inline std::vector<uint8_t> RandomCodes(int64_t n, Fp8Format format, float stddev,
                                        float* scale_inv) {
  const std::vector<float> x = RandomNormal(n, stddev);
  const float scale = n == 0 ? 1.0f : ComputeScale(Amax(x.data(), n), format, 0);
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  if (n > 0) QuantizeFp8(x.data(), 1, n, scale, format, codes.data(), nullptr, nullptr);
  *scale_inv = 1.0f / scale;
  return codes;
}

}  // namespace gradwire::kernels::test_data
