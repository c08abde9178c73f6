#include "server/core/contexts/offload.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace gradwire::core {

struct HostPack::Item {
  bool defined = false;
  at::Device device = at::kCPU;  // where the tensor lived, and goes back to
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;
  std::unique_ptr<uint8_t[]> data;
  int64_t bytes = 0;
};

HostPack::HostPack() = default;
HostPack::~HostPack() = default;

absl::StatusOr<std::unique_ptr<HostPack>> HostPack::Pack(SavedTensors& saved) {
  std::unique_ptr<HostPack> pack(new HostPack());
  // Copy everything first, drop the originals only once every copy exists.
  try {
    saved.ForEachTensor([&](at::Tensor& t) {
      Item item;
      if (t.defined()) {
        const at::Tensor c = t.to(at::kCPU).contiguous();
        item.defined = true;
        item.device = t.device();
        item.dtype = c.scalar_type();
        item.sizes.assign(c.sizes().begin(), c.sizes().end());
        item.bytes = int64_t(c.nbytes());
        item.data.reset(new uint8_t[std::max<int64_t>(item.bytes, 1)]);
        std::memcpy(item.data.get(), c.data_ptr(), size_t(item.bytes));
        pack->bytes_ += item.bytes;
      }
      pack->items_.push_back(std::move(item));
    });
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("no host memory for an offloaded context");
  }
  saved.ForEachTensor([](at::Tensor& t) { t = at::Tensor(); });
  return pack;
}

absl::Status HostPack::Unpack(SavedTensors& saved) const {
  std::vector<at::Tensor> restored;
  restored.reserve(items_.size());
  try {
    for (const Item& item : items_) {
      if (!item.defined) {
        restored.emplace_back();
        continue;
      }
      // A view of the host buffer, copied into memory of its own on its device.
      const at::Tensor view =
          at::from_blob(item.data.get(), item.sizes, at::TensorOptions().dtype(item.dtype));
      restored.push_back(item.device.is_cpu() ? view.clone() : view.to(item.device));
    }
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot restore an offloaded context: ", e.what()));
  }
  size_t next = 0;
  bool mismatch = false;
  saved.ForEachTensor([&](at::Tensor& t) {
    if (next < restored.size()) {
      t = std::move(restored[next]);
    } else {
      mismatch = true;
    }
    ++next;
  });
  if (mismatch || next != restored.size()) {
    return absl::InternalError("an offloaded context changed its tensor list");
  }
  return absl::OkStatus();
}

}  // namespace gradwire::core
