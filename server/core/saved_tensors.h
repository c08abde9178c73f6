// What a training forward leaves for its backward. Modules derive their own saved state.
#pragma once

#include <cstdint>
#include <vector>

namespace gradwire::core {

class SavedTensors {
 public:
  virtual ~SavedTensors() = default;
  // Bytes of tensor memory this context owns (shared workspaces are not counted).
  virtual int64_t bytes() const = 0;

  std::vector<int64_t> input_shape;  // the forward input as the client sent it: [..., K]
};

}  // namespace gradwire::core
