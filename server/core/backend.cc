// What every backend shares: fresh fp32 tensors on its device.
#include "server/core/backend.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <vector>

namespace gradwire::core {

at::Tensor Backend::Empty(at::IntArrayRef shape) const {
  return at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(device()));
}

at::Tensor Backend::Zeros(at::IntArrayRef shape) const {
  return at::zeros(shape, at::TensorOptions().dtype(at::kFloat).device(device()));
}

at::Tensor Backend::FpropGroups(const Fp8Tensor& x, const Fp8Tensor& w,
                                const at::Tensor& bias) const {
  std::vector<at::Tensor> parts;
  parts.reserve(x.groups.size());
  for (const Fp8Tensor& g : x.groups) parts.push_back(Fprop(g, w, bias));
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

at::Tensor Backend::DgradGroups(const Fp8Tensor& dy, const Fp8Tensor& w) const {
  std::vector<at::Tensor> parts;
  parts.reserve(dy.groups.size());
  for (const Fp8Tensor& g : dy.groups) parts.push_back(Dgrad(g, w));
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

namespace {
std::atomic<int64_t> cuda_staging{-1};  // -1: not set, read the environment
}  // namespace

void SetCudaStaging(int64_t chunk_bytes) { cuda_staging = std::max<int64_t>(chunk_bytes, 0); }

int64_t CudaStaging() {
  int64_t v = cuda_staging.load();
  if (v >= 0) return v;
  const char* env = std::getenv("GRADWIRE_CUDA_STAGING_MIB");
  v = env != nullptr ? std::clamp<int64_t>(std::atoll(env), 0, 1024) << 20 : 0;
  cuda_staging = v;
  return v;
}

}  // namespace gradwire::core
