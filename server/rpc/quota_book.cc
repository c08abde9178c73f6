#include "server/rpc/quota_book.h"

#include <functional>
#include <map>

#include "absl/strings/str_cat.h"

namespace gradwire::rpc {
namespace {

// Subtracts `bytes` from `map[key]`, dropping the entry once nothing is held.
void Subtract(std::unordered_map<std::string, int64_t>& map, const std::string& key,
              int64_t bytes) {
  auto it = map.find(key);
  if (it != map.end() && (it->second -= bytes) <= 0) map.erase(it);
}

// Adds `bytes` to what `client` holds in `held` unless that would pass `quota` (0: none);
// `refusal` words the RESOURCE_EXHAUSTED from what the client held before.
absl::Status Reserve(std::unordered_map<std::string, int64_t>& held, const std::string& client,
                     int64_t bytes, int64_t quota,
                     const std::function<std::string(int64_t was)>& refusal) {
  auto it = held.find(client);
  const int64_t was = it == held.end() ? 0 : it->second;
  if (quota > 0 && was + bytes > quota) return absl::ResourceExhaustedError(refusal(was));
  held[client] = was + bytes;
  return absl::OkStatus();
}

}  // namespace

Admission& Admission::operator=(Admission&& other) noexcept {
  if (this != &other) {
    Release();
    book_ = std::exchange(other.book_, nullptr);
    module_key_ = std::move(other.module_key_);
    client_key_ = std::move(other.client_key_);
    started_ = std::exchange(other.started_, false);
  }
  return *this;
}

void Admission::Start() {
  if (book_ == nullptr || started_) return;
  book_->Started(module_key_, client_key_);
  started_ = true;
}

void Admission::Release() {
  if (book_ == nullptr) return;
  QuotaBook* book = std::exchange(book_, nullptr);
  if (std::exchange(started_, false)) {
    book->Ended(module_key_);
  } else {
    book->Dequeued(module_key_, client_key_);
  }
}

QuotaBook::QuotaBook(const ServiceLimits& limits, const ClientQuotas& quotas)
    : limits_(limits), quotas_(quotas) {}

absl::Status QuotaBook::Admit(const std::string& client, std::string module_key,
                              Admission* admission) {
  const int64_t per_module = limits_.max_queued_per_module;
  const int64_t per_client = limits_.max_queued_per_client;
  std::lock_guard<std::mutex> lock(mu_);
  if (!module_key.empty() && per_module > 0) {
    auto it = queued_.find(module_key);
    if (it != queued_.end() && it->second >= per_module) {
      return absl::ResourceExhaustedError(
          absl::StrCat("module ", module_key, " has ", per_module,
                       " calls queued, the limit (--max-queued-per-module); retry with backoff"));
    }
  }
  if (per_client > 0) {
    auto it = queued_by_client_.find(client);
    if (it != queued_by_client_.end() && it->second >= per_client) {
      return absl::ResourceExhaustedError(
          absl::StrCat(client, " has ", per_client,
                       " calls queued, the limit (--max-queued-per-client); retry with backoff"));
    }
  }
  if (!module_key.empty()) ++queued_[module_key];
  ++queued_by_client_[client];
  *admission = Admission(this, std::move(module_key), client);
  return absl::OkStatus();
}

int64_t QuotaBook::queued_calls(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = queued_.find(module_id);
  return it == queued_.end() ? 0 : it->second;
}

void QuotaBook::Dequeued(const std::string& module_key, const std::string& client_key) {
  std::lock_guard<std::mutex> lock(mu_);
  Subtract(queued_, module_key, 1);
  Subtract(queued_by_client_, client_key, 1);
}

void QuotaBook::Started(const std::string& module_key, const std::string& client_key) {
  std::lock_guard<std::mutex> lock(mu_);
  Subtract(queued_, module_key, 1);
  Subtract(queued_by_client_, client_key, 1);
  if (!module_key.empty()) ++running_[module_key];
}

void QuotaBook::Ended(const std::string& module_key) {
  std::lock_guard<std::mutex> lock(mu_);
  Subtract(running_, module_key, 1);
}

int64_t QuotaBook::busy_calls(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t busy = 0;
  if (auto it = queued_.find(module_id); it != queued_.end()) busy += it->second;
  if (auto it = running_.find(module_id); it != running_.end()) busy += it->second;
  return busy;
}

absl::Status QuotaBook::ReserveStreamBytes(const std::string& client, int64_t bytes) {
  const int64_t quota = quotas_.stream_bytes;
  std::lock_guard<std::mutex> lock(mu_);
  return Reserve(stream_bytes_, client, bytes, quota, [&](int64_t was) {
    return absl::StrCat("this chunked request declares ", bytes, " bytes and ", client, " has ",
                        was, " in flight already, over the quota of ", quota,
                        " bytes (--max-stream-bytes-per-client); finish or cancel the others "
                        "first");
  });
}

void QuotaBook::ReturnStreamBytes(const std::string& client, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Subtract(stream_bytes_, client, bytes);
}

absl::Status QuotaBook::ReserveParameters(const std::string& client, int64_t bytes) {
  const int64_t quota = quotas_.parameter_bytes;
  std::lock_guard<std::mutex> lock(mu_);
  return Reserve(parameter_bytes_, client, bytes, quota, [&](int64_t was) {
    return absl::StrCat("this module's parameters take ", bytes, " bytes and ", client,
                        "'s modules ", was, " already, over the quota of ", quota,
                        " bytes (--max-parameter-bytes-per-client); delete modules first");
  });
}

void QuotaBook::KeepParameters(const std::string& module_id, const std::string& client,
                               int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  module_bytes_[module_id] = {client, bytes};
}

void QuotaBook::ReturnParameters(const std::string& client, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Subtract(parameter_bytes_, client, bytes);
}

void QuotaBook::ModuleDeleted(const std::string& module_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = module_bytes_.find(module_id);
  if (it == module_bytes_.end()) return;
  Subtract(parameter_bytes_, it->second.first, it->second.second);
  module_bytes_.erase(it);
}

void QuotaBook::CountExisting(const std::string& module_id, const std::string& client,
                              int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  parameter_bytes_[client] += bytes;
  module_bytes_[module_id] = {client, bytes};
}

std::vector<ClientUsage> QuotaBook::Usage(
    const std::unordered_map<std::string, int64_t>& context_bytes) const {
  std::map<std::string, ClientUsage> by_client;
  auto at = [&](const std::string& client) -> ClientUsage& {
    ClientUsage& u = by_client[client];
    u.client = client;
    return u;
  };
  for (const auto& [client, bytes] : context_bytes) at(client).context_bytes = bytes;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [client, bytes] : parameter_bytes_) at(client).parameter_bytes = bytes;
  for (const auto& [client, bytes] : stream_bytes_) at(client).stream_bytes = bytes;
  for (const auto& [client, n] : queued_by_client_) at(client).queued = n;
  std::vector<ClientUsage> out;
  for (auto& [client, usage] : by_client) out.push_back(std::move(usage));
  return out;
}

}  // namespace gradwire::rpc
