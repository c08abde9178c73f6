// Shared pieces of the CUDA kernel tests: a visible skip without a device, device buffers, and
// fresh random inputs whose seed is printed with every failure.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "device_query.h"
#include "gradwire/kernels/random.h"

namespace gradwire::kernels::cuda::testing {

// Compute capability of device 0 as major * 10 + minor (0 if it cannot be read).
inline int DeviceArch() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return 0;
  return prop.major * 10 + prop.minor;
}

// Skips the test, naming why, when this process sees no CUDA device, or one older than the sm_90
// the backend is built for (its compute_90 PTX cannot run there; FP8 tensor cores need sm_89+).
#define GW_REQUIRE_CUDA_DEVICE()                                                              \
  do {                                                                                        \
    std::string gw_why_;                                                                      \
    if (::gradwire::kernels::cuda::DeviceCount(&gw_why_) == 0)                                \
      GTEST_SKIP() << "no CUDA device (" << gw_why_ << "): GPU test not run";                 \
    if (const int gw_arch_ = ::gradwire::kernels::cuda::testing::DeviceArch(); gw_arch_ < 90) \
      GTEST_SKIP() << "CUDA device is sm_" << gw_arch_ << ", the backend is built for sm_90"; \
  } while (0)

// A device allocation of n elements of T, filled with a poison byte so that an element the
// kernel fails to write cannot pass for a result.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    GRADWIRE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), bytes() > 0 ? bytes() : 1));
    GRADWIRE_CUDA_CHECK(cudaMemset(ptr_, 0xA5, bytes()));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { Upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t bytes() const { return n_ * sizeof(T); }
  void Upload(const std::vector<T>& host) {
    GRADWIRE_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    GRADWIRE_CUDA_CHECK(cudaDeviceSynchronize());
    GRADWIRE_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  T Scalar() const { return Download().at(0); }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

// A fresh seed per call (printed by the caller's SCOPED_TRACE).
inline uint64_t FreshSeed() {
  return std::random_device{}() * 0x100000001ull + std::random_device{}();
}

// n normal values times `spread`, a function of seed.
inline std::vector<float> RandomNormal(int64_t n, uint64_t seed, float spread,
                                       uint64_t stream = 0) {
  std::vector<float> v(size_t(n > 0 ? n : 0));
  if (n > 0) FillNormal(v.data(), n, seed, stream);
  for (float& x : v) x *= spread;
  return v;
}

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

}  // namespace gradwire::kernels::cuda::testing
