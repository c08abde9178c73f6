// Several gradwire servers behind one interface. Each module is placed on one server (explicitly,
// or round-robin); every call about that module, or about a context one of its forwards created,
// goes to that server, so a backward always reaches the server that holds its saved tensors.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gradwire/client/client.h"

namespace gradwire::client {

class Cluster {
 public:
  static constexpr int kRoundRobin = -1;

  // One Client per endpoint, each with `base` but its own server address. Throws like Client
  // when a TLS file cannot be read.
  Cluster(const ClientOptions& base, const std::vector<std::string>& endpoints);

  // "host:port,host:port,..." -> endpoints; INVALID_ARGUMENT for an empty or repeated entry.
  static absl::StatusOr<std::vector<std::string>> ParseEndpoints(const std::string& list);

  size_t size() const { return clients_.size(); }
  Client& endpoint(size_t i) { return *clients_.at(i); }
  const std::string& address(size_t i) const { return clients_.at(i)->options().server; }

  // Waits for every endpoint; UNAVAILABLE naming the first that is not ready.
  absl::Status WaitForReady(std::chrono::milliseconds timeout);

  // Creates the module on endpoint `where` (0-based), or on the next one in turn with
  // kRoundRobin; remembers where it lives.
  absl::StatusOr<v1::ModuleInfo> CreateModule(const v1::ModuleSpec& spec, int where = kRoundRobin);
  // Where a module lives: remembered, or else found by asking every endpoint (a module created by
  // another process). NOT_FOUND when no endpoint has it.
  absl::StatusOr<size_t> Locate(const std::string& module_id);
  absl::Status DeleteModule(const std::string& module_id);

  absl::StatusOr<ForwardResult> Forward(const std::string& module_id, const HostTensor& input,
                                        bool training);
  // NOT_FOUND for a context this cluster's forwards did not create.
  absl::StatusOr<HostTensor> Backward(const std::string& context_id, const HostTensor& grad_output,
                                      BackwardOptions options = {});
  absl::Status ReleaseContext(const std::string& context_id);
  absl::StatusOr<uint64_t> ApplyGradients(const std::string& module_id, float learning_rate = 0.0f);
  absl::StatusOr<NamedTensors> GetWeights(const std::string& module_id);
  absl::StatusOr<uint64_t> SetWeights(
      const std::string& module_id,
      const std::vector<std::pair<std::string, HostTensor>>& parameters);

  // Live contexts this cluster routes (created by training forwards, not yet consumed).
  size_t routed_contexts() const;

 private:
  absl::StatusOr<Client*> ForModule(const std::string& module_id);
  absl::StatusOr<size_t> ContextServer(const std::string& context_id) const;

  std::vector<std::unique_ptr<Client>> clients_;
  mutable std::mutex mu_;                             // guards the maps and next_
  std::unordered_map<std::string, size_t> modules_;   // module id -> endpoint
  std::unordered_map<std::string, size_t> contexts_;  // context id -> endpoint
  size_t next_ = 0;
};

}  // namespace gradwire::client
