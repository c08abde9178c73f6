// Moving a context's saved tensors off the device and back (DESIGN.md, bounded memory): Pack
// copies every tensor a context owns into host buffers and drops the originals, so their device
// memory is freed; Unpack allocates them again and copies the bytes back.
//
// On the CPU backend the "device" is host memory too, and the host buffers are plain heap
// allocations accounted separately from the device budget. Tensors on another device are copied
// to host and back synchronously; a CUDA backend should pack into pinned buffers so the copies can
// run asynchronously on the executor's stream.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/kinds/saved_tensors.h"

namespace gradwire::core {

class HostPack {
 public:
  HostPack(const HostPack&) = delete;
  HostPack& operator=(const HostPack&) = delete;
  ~HostPack();

  // Copies `saved`'s tensors into host buffers and leaves them undefined in `saved`. Nothing
  // changes in `saved` unless this succeeds (RESOURCE_EXHAUSTED when host memory cannot be had).
  static absl::StatusOr<std::unique_ptr<HostPack>> Pack(SavedTensors& saved);

  // Puts the tensors back into `saved` (contiguous, with their dtypes and shapes). On failure
  // `saved` keeps its undefined tensors and the pack stays usable.
  absl::Status Unpack(SavedTensors& saved) const;

  // Bytes held in host buffers.
  int64_t bytes() const { return bytes_; }

 private:
  struct Item;
  HostPack();
  std::vector<Item> items_;
  int64_t bytes_ = 0;
};

}  // namespace gradwire::core
