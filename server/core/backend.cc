// What every backend shares: fresh fp32 tensors on its device.
#include "server/core/backend.h"

#include <ATen/ATen.h>

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

}  // namespace gradwire::core
