// The service's counts per client and per module, under a lock of their own: calls queued for an
// executor (--max-queued-per-module, --max-queued-per-client), bytes of chunked requests being
// received (--max-stream-bytes-per-client) and fp32 parameter bytes of each client's modules
// (--max-parameter-bytes-per-client). A client is a tenant with tokens, else a peer host. Each
// refusal is RESOURCE_EXHAUSTED naming the flag and counts nothing. The saved-context quota is
// the context store's (core::ContextLimits::client_bytes).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "server/rpc/options.h"
#include "server/rpc/usage.h"

namespace gradwire::rpc {

class QuotaBook;

// A call counted in the queue bounds (its module's and its client's) from admission until its
// work starts, or until it is dropped.
class Admission {
 public:
  Admission() = default;
  Admission(Admission&& other) noexcept { *this = std::move(other); }
  Admission& operator=(Admission&& other) noexcept;
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;
  ~Admission() { Release(); }
  // The call leaves the queue and runs: it no longer counts for the queue bounds, and its module
  // stays busy (QuotaBook::busy_calls) until Release.
  void Start();
  void Release();

 private:
  friend class QuotaBook;
  Admission(QuotaBook* book, std::string module_key, std::string client_key)
      : book_(book), module_key_(std::move(module_key)), client_key_(std::move(client_key)) {}
  QuotaBook* book_ = nullptr;
  std::string module_key_, client_key_;
  bool started_ = false;
};

class QuotaBook {
 public:
  QuotaBook(const ServiceLimits& limits, const ClientQuotas& quotas);
  QuotaBook(const QuotaBook&) = delete;
  QuotaBook& operator=(const QuotaBook&) = delete;

  // Counts one call of `client`, and of `module_key` unless empty, until `*admission` is released;
  // refused when either bound is full.
  absl::Status Admit(const std::string& client, std::string module_key, Admission* admission);
  // Calls counted for `module_id` that have not started yet.
  int64_t queued_calls(const std::string& module_id) const;
  // Calls counted for `module_id` that are queued or running: admitted and not yet ended. A
  // module with any is busy, and no TTL takes it from under them.
  int64_t busy_calls(const std::string& module_id) const;

  // Chunked bytes in flight: reserved when a request's header is accepted, returned when the
  // request is dropped.
  absl::Status ReserveStreamBytes(const std::string& client, int64_t bytes);
  void ReturnStreamBytes(const std::string& client, int64_t bytes);

  // Parameter bytes: reserved before a module is created, then kept under its id
  // (KeepParameters) or returned when the creation fails; a module's bytes go back with it.
  absl::Status ReserveParameters(const std::string& client, int64_t bytes);
  void KeepParameters(const std::string& module_id, const std::string& client, int64_t bytes);
  void ReturnParameters(const std::string& client, int64_t bytes);
  void ModuleDeleted(const std::string& module_id);
  // A module that was there before the service (restored from a checkpoint): counted, whatever
  // the quota.
  void CountExisting(const std::string& module_id, const std::string& client, int64_t bytes);

  // Every client that holds anything now, with the context bytes the context store counts.
  std::vector<ClientUsage> Usage(
      const std::unordered_map<std::string, int64_t>& context_bytes) const;

 private:
  friend class Admission;
  void Dequeued(const std::string& module_key, const std::string& client_key);
  void Started(const std::string& module_key, const std::string& client_key);
  void Ended(const std::string& module_key);

  const ServiceLimits limits_;
  const ClientQuotas quotas_;
  mutable std::mutex mu_;                                      // guards the six maps below
  std::unordered_map<std::string, int64_t> queued_;            // module -> calls not started
  std::unordered_map<std::string, int64_t> queued_by_client_;  // client -> calls not started
  std::unordered_map<std::string, int64_t> running_;           // module -> calls started, not ended
  std::unordered_map<std::string, int64_t> stream_bytes_;      // client -> chunked bytes held
  std::unordered_map<std::string, int64_t> parameter_bytes_;   // client -> fp32 parameter bytes
  // module -> the client holding its parameter bytes, and how many
  std::unordered_map<std::string, std::pair<std::string, int64_t>> module_bytes_;
};

}  // namespace gradwire::rpc
