// What every backend shares: fresh fp32 tensors on its device.
#include "server/core/backend.h"

#include <ATen/ATen.h>

namespace gradwire::core {

at::Tensor Backend::Empty(at::IntArrayRef shape) const {
  return at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(device()));
}

at::Tensor Backend::Zeros(at::IntArrayRef shape) const {
  return at::zeros(shape, at::TensorOptions().dtype(at::kFloat).device(device()));
}

}  // namespace gradwire::core
