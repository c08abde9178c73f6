#include "gradwire/client/cluster.h"

#include <set>

#include "absl/strings/str_cat.h"

namespace gradwire::client {

Cluster::Cluster(const ClientOptions& base, const std::vector<std::string>& endpoints) {
  for (const std::string& address : endpoints) {
    ClientOptions options = base;
    options.server = address;
    clients_.push_back(std::make_unique<Client>(options));
  }
}

absl::StatusOr<std::vector<std::string>> Cluster::ParseEndpoints(const std::string& list) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  size_t start = 0;
  while (true) {
    const size_t comma = list.find(',', start);
    std::string item = list.substr(start, comma == std::string::npos ? comma : comma - start);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (item.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "server list '", list, "' has an empty entry (want HOST:PORT[,HOST:PORT...])"));
    }
    if (!seen.insert(item).second) {
      return absl::InvalidArgumentError(absl::StrCat("server ", item, " is listed twice"));
    }
    out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

absl::Status Cluster::WaitForReady(std::chrono::milliseconds timeout) {
  for (auto& c : clients_) {
    if (auto s = c->WaitForReady(timeout); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ModuleInfo> Cluster::CreateModule(const v1::ModuleSpec& spec, int where) {
  if (clients_.empty()) return absl::FailedPreconditionError("the cluster has no servers");
  size_t target;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (where == kRoundRobin) {
      target = next_++ % clients_.size();
    } else if (where < 0 || size_t(where) >= clients_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "placement ", where, " is not a server index (0..", clients_.size() - 1, ")"));
    } else {
      target = size_t(where);
    }
  }
  auto info = clients_[target]->CreateModule(spec);
  if (!info.ok()) return info.status();
  std::lock_guard<std::mutex> lock(mu_);
  modules_[info->module_id()] = target;
  return info;
}

absl::StatusOr<size_t> Cluster::Locate(const std::string& module_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = modules_.find(module_id); it != modules_.end()) return it->second;
  }
  for (size_t i = 0; i < clients_.size(); ++i) {
    auto modules = clients_[i]->ListModules();
    if (!modules.ok()) return modules.status();
    for (const v1::ModuleInfo& m : *modules) {
      if (m.module_id() == module_id) {
        std::lock_guard<std::mutex> lock(mu_);
        modules_[module_id] = i;
        return i;
      }
    }
  }
  return absl::NotFoundError(
      absl::StrCat("module_id ", module_id, " is on none of the ", clients_.size(), " servers"));
}

absl::StatusOr<size_t> Cluster::ContextServer(const std::string& context_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(context_id);
  if (it == contexts_.end()) {
    return absl::NotFoundError(absl::StrCat("context_id ", context_id,
                                            " was not created by a forward through this cluster"));
  }
  return it->second;
}

absl::StatusOr<Client*> Cluster::ForModule(const std::string& module_id) {
  auto where = Locate(module_id);
  if (!where.ok()) return where.status();
  return clients_[*where].get();
}

absl::Status Cluster::DeleteModule(const std::string& module_id) {
  auto c = ForModule(module_id);
  if (!c.ok()) return c.status();
  auto s = (*c)->DeleteModule(module_id);
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    modules_.erase(module_id);
  }
  return s;
}

absl::StatusOr<ForwardResult> Cluster::Forward(const std::string& module_id,
                                               const HostTensor& input, bool training) {
  auto where = Locate(module_id);
  if (!where.ok()) return where.status();
  auto out = clients_[*where]->Forward(module_id, input, training);
  if (out.ok() && !out->context_id.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    contexts_[out->context_id] = *where;
  }
  return out;
}

absl::StatusOr<HostTensor> Cluster::Backward(const std::string& context_id,
                                             const HostTensor& grad_output,
                                             BackwardOptions options) {
  auto found = ContextServer(context_id);
  if (!found.ok()) return found.status();
  const size_t where = *found;
  auto out = clients_[where]->Backward(context_id, grad_output, options);
  // A consumed context is gone on the server; so is one the server no longer knows.
  if ((out.ok() && !options.retain) || absl::IsNotFound(out.status())) {
    std::lock_guard<std::mutex> lock(mu_);
    contexts_.erase(context_id);
  }
  return out;
}

absl::Status Cluster::ReleaseContext(const std::string& context_id) {
  auto found = ContextServer(context_id);
  if (!found.ok()) return found.status();
  const size_t where = *found;
  auto s = clients_[where]->ReleaseContext(context_id);
  if (s.ok() || absl::IsNotFound(s)) {
    std::lock_guard<std::mutex> lock(mu_);
    contexts_.erase(context_id);
  }
  return s;
}

absl::StatusOr<uint64_t> Cluster::ApplyGradients(const std::string& module_id,
                                                 float learning_rate) {
  auto c = ForModule(module_id);
  if (!c.ok()) return c.status();
  return (*c)->ApplyGradients(module_id, learning_rate);
}

absl::StatusOr<NamedTensors> Cluster::GetWeights(const std::string& module_id) {
  auto c = ForModule(module_id);
  if (!c.ok()) return c.status();
  return (*c)->GetWeights(module_id);
}

absl::StatusOr<uint64_t> Cluster::SetWeights(
    const std::string& module_id,
    const std::vector<std::pair<std::string, HostTensor>>& parameters) {
  auto c = ForModule(module_id);
  if (!c.ok()) return c.status();
  return (*c)->SetWeights(module_id, parameters);
}

size_t Cluster::routed_contexts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return contexts_.size();
}

}  // namespace gradwire::client
