// A step's float32 result, written by its GEMM straight into the response's bytes.
//
// A forward's output (and a Linear backward's grad_input) leaves as float32 bytes that are the
// tensor's own. On a host backend the last GEMM can write them in place (Backend::FpropInto,
// DgradInto): the bytes are allocated before the kind call, lent to it as a tensor
// (KindForwardArgs::output_into, KindBackwardArgs::grad_input_into), and handed on whole
// afterwards, so the result is neither allocated apart nor copied to be encoded. Internal to
// the step runner.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gradwire/wire/codec.h"
#include "server/device/backend.h"

namespace gradwire::core {

class WireDestination {
 public:
  // Below this, the copy saved is small next to the call: the result is encoded as usual.
  static constexpr int64_t kMinBytes = int64_t(1) << 20;

  // Allocates the bytes of a float32 [rows, cols] result when `backend` keeps its tensors in
  // host memory, its GEMMs write in place, and they come to at least kMinBytes; otherwise
  // view() stays undefined.
  void Prepare(const device::Backend& backend, int64_t rows, int64_t cols) {
    const int64_t n = rows * cols * int64_t(sizeof(float));
    if (!backend.device().is_cpu() || !backend.GemmsWriteInPlace() || rows <= 0 || cols <= 0 ||
        n < kMinBytes) {
      return;
    }
    bytes_.resize(size_t(n));
    view_ = at::from_blob(bytes_.data(), {rows, cols}, at::TensorOptions().dtype(at::kFloat));
  }

  // The lent tensor (undefined when nothing was prepared).
  const at::Tensor& view() const { return view_; }

  // Whether `result` is the lent tensor, whole: the kind wrote its result there.
  bool Holds(const at::Tensor& result) const {
    return view_.defined() && result.defined() && result.data_ptr() == view_.data_ptr() &&
           result.numel() == view_.numel() && result.scalar_type() == at::kFloat;
  }

  // The bytes as the response's float32 tensor of `shape`. A string of kMinBytes or more moves
  // its buffer with it, so tensors viewing the bytes stay valid while the returned tensor (or
  // whatever it moves into) lives, and must not outlive it.
  wire::EncodedTensor Take(std::vector<int64_t> shape) {
    wire::EncodedTensor e;
    e.dtype = wire::DType::kF32;
    e.shape = std::move(shape);
    e.bytes = std::move(bytes_);
    view_ = at::Tensor();
    return e;
  }

 private:
  std::string bytes_;
  at::Tensor view_;
};

}  // namespace gradwire::core
