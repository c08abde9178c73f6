#include "server/core/context_store.h"

#include <random>

#include "absl/strings/str_cat.h"

namespace gradwire::core {

std::string RandomId128() {
  thread_local std::mt19937_64 engine{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id(32, '0');
  for (int half = 0; half < 2; ++half) {
    uint64_t bits = engine();
    for (int i = 0; i < 16; ++i, bits >>= 4) id[half * 16 + i] = kHex[bits & 0xF];
  }
  return id;
}

std::string ContextStore::Put(std::string module_id, uint64_t weight_version,
                              std::shared_ptr<SavedTensors> saved, std::string tenant) {
  Entry entry;
  entry.module_id = std::move(module_id);
  entry.tenant = std::move(tenant);
  entry.weight_version = weight_version;
  entry.bytes = saved->bytes();
  entry.saved = std::move(saved);
  std::lock_guard<std::mutex> lock(mu_);
  std::string id;
  do {
    id = RandomId128();
  } while (entries_.count(id) || consumed_.count(id));
  live_bytes_ += entry.bytes;
  entries_.emplace(id, std::move(entry));
  return id;
}

absl::Status ContextStore::CheckTenant(const std::string& context_id,
                                       const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string* owner = nullptr;
  if (auto it = entries_.find(context_id); it != entries_.end()) {
    owner = &it->second.tenant;
  } else if (auto c = consumed_.find(context_id); c != consumed_.end()) {
    owner = &c->second;
  }
  if (owner == nullptr || *owner != tenant) {
    return absl::NotFoundError(absl::StrCat("context_id ", context_id, " is not a live context"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ContextStore::Lease> ContextStore::Acquire(const std::string& context_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(context_id);
  if (it == entries_.end()) {
    if (consumed_.count(context_id)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "context_id ", context_id,
          " was already consumed by a backward; set retain=true on the first backward to run "
          "another"));
    }
    return absl::NotFoundError(absl::StrCat("context_id ", context_id, " is not a live context"));
  }
  if (it->second.in_backward) {
    return absl::FailedPreconditionError(
        absl::StrCat("context_id ", context_id, " has a backward running"));
  }
  it->second.in_backward = true;
  return Lease{it->second.module_id, it->second.weight_version, it->second.saved};
}

void ContextStore::Finish(const std::string& context_id, bool consumed, bool retain) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(context_id);
  if (it == entries_.end()) return;
  it->second.in_backward = false;
  if (consumed && !retain) EraseLocked(it, /*remember=*/true);
}

absl::Status ContextStore::Release(const std::string& context_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(context_id);
  if (it == entries_.end()) {
    if (consumed_.count(context_id)) return absl::OkStatus();
    return absl::NotFoundError(absl::StrCat("context_id ", context_id, " is not a live context"));
  }
  if (it->second.in_backward) {
    return absl::FailedPreconditionError(
        absl::StrCat("context_id ", context_id, " has a backward running"));
  }
  EraseLocked(it, /*remember=*/true);
  return absl::OkStatus();
}

int64_t ContextStore::ReleaseModule(const std::string& module_id) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t released = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (it->second.module_id == module_id) {
      EraseLocked(it, /*remember=*/false);
      ++released;
    }
    it = next;
  }
  return released;
}

void ContextStore::EraseLocked(std::unordered_map<std::string, Entry>::iterator it, bool remember) {
  live_bytes_ -= it->second.bytes;
  if (remember) {
    consumed_.emplace(it->first, it->second.tenant);
    consumed_order_.push_back(it->first);
    if (consumed_order_.size() > kConsumedMemory) {
      consumed_.erase(consumed_order_.front());
      consumed_order_.pop_front();
    }
  }
  entries_.erase(it);
}

int64_t ContextStore::live_contexts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int64_t(entries_.size());
}

int64_t ContextStore::live_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_bytes_;
}

int64_t ContextStore::live_contexts(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t count = 0;
  for (const auto& [id, entry] : entries_) count += entry.module_id == module_id;
  return count;
}

std::weak_ptr<SavedTensors> ContextStore::Peek(const std::string& context_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(context_id);
  return it == entries_.end() ? std::weak_ptr<SavedTensors>() : it->second.saved;
}

}  // namespace gradwire::core
