// Counter-based deterministic random numbers: the same (seed, stream, index) gives the same value
// on every machine and backend, so a module created with a seed has the same weights everywhere.
#pragma once

#include <cstdint>

namespace gradwire::kernels {

// out[i] uniform in [lo, hi) for i in [0, n), a function of (seed, stream, i) only.
void FillUniform(float* out, int64_t n, uint64_t seed, uint64_t stream, float lo, float hi);

// out[i] standard normal (Box-Muller over the same counter stream).
void FillNormal(float* out, int64_t n, uint64_t seed, uint64_t stream);

}  // namespace gradwire::kernels
