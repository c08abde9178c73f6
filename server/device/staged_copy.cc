#include "server/device/staged_copy.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "gradwire/kernels/cpu/parallel.h"

namespace gradwire::device {

void ParallelMemcpy(void* dst, const void* src, size_t n) {
  if (n == 0) return;
  constexpr int64_t kGrain = int64_t(1) << 20;  // below 2 MiB one thread does it
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  kernels::cpu::ParallelFor(int64_t(n), kGrain, [&](int64_t begin, int64_t end) {
    std::memcpy(d + begin, s + begin, size_t(end - begin));
  });
}

StagedCopier::StagedCopier(std::vector<void*> slots, size_t chunk_bytes, StagingOps ops,
                           std::function<void(void*, const void*, size_t)> host_copy)
    : slots_(std::move(slots)),
      chunk_(chunk_bytes),
      ops_(std::move(ops)),
      host_copy_(host_copy ? std::move(host_copy) : ParallelMemcpy) {
  if (slots_.size() < 2 || chunk_ == 0) {
    throw std::invalid_argument("StagedCopier: needs at least two slots of a positive size");
  }
}

void StagedCopier::ToDevice(void* device, const void* host, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto* d = static_cast<char*>(device);
  const auto* h = static_cast<const char*>(host);
  const int n_slots = slots();
  for (size_t off = 0, c = 0; off < bytes; off += chunk_, ++c) {
    const int s = int(c % size_t(n_slots));
    const size_t n = std::min(chunk_, bytes - off);
    ops_.wait(s);  // the crossing that last read this slot is done
    host_copy_(slots_[size_t(s)], h + off, n);
    ops_.to_device(d + off, slots_[size_t(s)], n);
    ops_.record(s);
  }
}

void StagedCopier::ToHost(void* host, const void* device, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto* h = static_cast<char*>(host);
  const auto* d = static_cast<const char*>(device);
  const int n_slots = slots();
  // Chunk c crosses into slot c % n_slots while the host empties chunk c - 1's slot. A slot is
  // refilled only after the host copied it out (n_slots >= 2: chunk c - n_slots was emptied in
  // an earlier iteration), and waiting on it first also covers a ToDevice that last used it.
  size_t prev_off = 0, prev_n = 0;
  int prev_slot = -1;
  for (size_t off = 0, c = 0; off < bytes; off += chunk_, ++c) {
    const int s = int(c % size_t(n_slots));
    const size_t n = std::min(chunk_, bytes - off);
    ops_.wait(s);
    ops_.to_host(slots_[size_t(s)], d + off, n);
    ops_.record(s);
    if (prev_slot >= 0) {
      ops_.wait(prev_slot);
      host_copy_(h + prev_off, slots_[size_t(prev_slot)], prev_n);
    }
    prev_off = off;
    prev_n = n;
    prev_slot = s;
  }
  if (prev_slot >= 0) {
    ops_.wait(prev_slot);
    host_copy_(h + prev_off, slots_[size_t(prev_slot)], prev_n);
  }
}

}  // namespace gradwire::device
