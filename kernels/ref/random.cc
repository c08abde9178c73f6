#include "gradwire/kernels/random.h"

#include <cmath>

namespace gradwire::kernels {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t Key(uint64_t seed, uint64_t stream) {
  return SplitMix64(seed) ^ SplitMix64(stream * 0xD1B54A32D192ED03ull + 1);
}

// 24 random bits as a float in [0, 1).
float Unit(uint64_t key, uint64_t index) {
  return float(SplitMix64(key + index) >> 40) * 0x1.0p-24f;
}

}  // namespace

void FillUniform(float* out, int64_t n, uint64_t seed, uint64_t stream, float lo, float hi) {
  const uint64_t key = Key(seed, stream);
  for (int64_t i = 0; i < n; ++i) out[i] = lo + (hi - lo) * Unit(key, uint64_t(i));
}

void FillNormal(float* out, int64_t n, uint64_t seed, uint64_t stream) {
  const uint64_t key = Key(seed, stream);
  for (int64_t i = 0; i < n; ++i) {
    const double u1 = 1.0 - double(Unit(key, 2 * uint64_t(i)));  // (0, 1]
    const double u2 = double(Unit(key, 2 * uint64_t(i) + 1));
    out[i] = float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
}

}  // namespace gradwire::kernels
