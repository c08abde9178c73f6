// What a training forward leaves for its backward. Modules derive their own saved state.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace at {
class Tensor;
}  // namespace at

namespace gradwire::core {

class SavedTensors {
 public:
  virtual ~SavedTensors() = default;
  // Bytes of tensor memory this context owns (shared workspaces are not counted).
  virtual int64_t bytes() const = 0;
  // Calls `fn` on every tensor this context owns (the ones bytes() counts), always in the same
  // order, undefined ones included: offload moves them to host memory and back through it.
  // Shared state (the weight workspace) is not visited.
  virtual void ForEachTensor(const std::function<void(at::Tensor&)>& fn) = 0;
  // Memory this context keeps alive but shares with other contexts (the FP8 weights of its weight
  // version, which its backward reads): the store counts each such object once, by its address,
  // for as long as a live context holds it. Not offloaded.
  virtual const void* shared_key() const { return nullptr; }
  virtual int64_t shared_bytes() const { return 0; }

  std::vector<int64_t> input_shape;  // the forward input as the client sent it: [..., K]
};

}  // namespace gradwire::core
