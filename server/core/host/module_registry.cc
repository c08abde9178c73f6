#include "server/core/host/module_registry.h"

#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"
#include "server/core/host/module.h"

namespace gradwire::core {

ModuleRegistry::ModuleRegistry(const Backend& backend, ContextStore& contexts,
                               ContextStore::Clock clock)
    : backend_(backend), contexts_(contexts), clock_(std::move(clock)) {}

int64_t ModuleRegistry::NowNs() const {
  const auto now = clock_ ? clock_() : std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
}

absl::StatusOr<ModuleInfo> ModuleRegistry::Create(const ModuleSpec& spec, const std::string& tenant,
                                                  const std::string& proposed) {
  auto taken = [&proposed] {
    return absl::AlreadyExistsError(
        absl::StrCat("module_id ", proposed, " is taken: propose another (a fresh random one)"));
  };
  if (!proposed.empty()) {  // before the parameters are allocated; checked again below
    std::lock_guard<std::mutex> lock(mu_);
    if (modules_.count(proposed)) return taken();
  }
  GW_ASSIGN_OR_RETURN(ModulePtr m, NewModule(spec, backend_));
  m->tenant = tenant;
  std::lock_guard<std::mutex> lock(mu_);
  std::string id = proposed;
  if (!id.empty() && modules_.count(id)) return taken();
  while (id.empty() || modules_.count(id)) id = RandomId128();
  m->last_used_ns.store(NowNs(), std::memory_order_relaxed);
  modules_.emplace(id, m);
  ArrivedLocked(id);
  std::lock_guard<std::mutex> module_lock(m->mu);
  return InfoLocked(id, *m);
}

absl::Status ModuleRegistry::Insert(const std::string& id, std::shared_ptr<Module> module) {
  module->last_used_ns.store(NowNs(), std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  if (!modules_.emplace(id, std::move(module)).second) {
    return absl::AlreadyExistsError(absl::StrCat("module_id ", id, " exists"));
  }
  ArrivedLocked(id);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Module>> ModuleRegistry::Find(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = modules_.find(module_id);
  if (it == modules_.end()) return MissingLocked(module_id, nullptr);
  return it->second;
}

absl::Status ModuleRegistry::MissingLocked(const std::string& module_id,
                                           const std::string* tenant) const {
  auto moved = moved_.find(module_id);
  if (moved != moved_.end() && (tenant == nullptr || moved->second.first == *tenant)) {
    return ModuleMovedError(
        module_id,
        "this server handed it over or let it go after this call was admitted (another server "
        "sharing the checkpoint directory holds it now), and no longer serves it. Behind a proxy, "
        "retry: the call goes where the module is now");
  }
  return absl::NotFoundError(absl::StrCat("module_id ", module_id, " is not a module"));
}

void ModuleRegistry::Renew(const Module& module) const {
  module.last_used_ns.store(NowNs(), std::memory_order_relaxed);
}

absl::Status ModuleRegistry::Touch(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  Renew(*m);
  return absl::OkStatus();
}

std::vector<std::string> ModuleRegistry::ExpireIdle(double ttl_s, const Busy& busy) {
  std::vector<std::string> expired;
  if (!(ttl_s > 0)) return expired;
  const int64_t cutoff = NowNs() - int64_t(ttl_s * 1e9);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = modules_.begin(); it != modules_.end();) {
      // Under mu_, no call can find the module meanwhile; one that holds it already (the map's is
      // then not the only reference) keeps it until its success renews it, or it ends.
      if (it->second->last_used_ns.load(std::memory_order_relaxed) < cutoff &&
          it->second.use_count() == 1 && !(busy && busy(it->first))) {
        expired.push_back(it->first);
        it = modules_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const std::string& id : expired) contexts_.ReleaseModule(id);
  expired_ += int64_t(expired.size());
  return expired;
}

ModuleInfo ModuleRegistry::InfoLocked(const std::string& id, const Module& m) const {
  return ModuleInfo{id,
                    m.tenant,
                    m.spec,
                    m.weights.version,
                    contexts_.live_contexts(id),
                    m.gradients.optimizer_steps,
                    m.weights.Names(),
                    backend_.SumsColumnsInRowOrder()};
}

absl::StatusOr<ModuleInfo> ModuleRegistry::Info(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  return InfoLocked(module_id, *m);
}

absl::Status ModuleRegistry::CheckTenant(const std::string& module_id,
                                         const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = modules_.find(module_id);
  if (it == modules_.end()) return MissingLocked(module_id, &tenant);
  if (it->second->tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("module_id ", module_id, " is not a module"));
  }
  return absl::OkStatus();
}

std::vector<ModuleInfo> ModuleRegistry::List(const std::string* tenant) const {
  std::map<std::string, std::shared_ptr<Module>> snapshot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    snapshot = modules_;
  }
  std::vector<ModuleInfo> out;
  for (const auto& [id, m] : snapshot) {
    if (tenant != nullptr && m->tenant != *tenant) continue;
    std::lock_guard<std::mutex> lock(m->mu);
    out.push_back(InfoLocked(id, *m));
  }
  return out;
}

absl::StatusOr<ModuleSpec> ModuleRegistry::Spec(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  return m->spec;
}

bool ModuleRegistry::Has(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return modules_.count(module_id) > 0;
}

absl::Status ModuleRegistry::Delete(const std::string& module_id, bool moved) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = modules_.find(module_id);
    if (it == modules_.end()) {
      return absl::NotFoundError(absl::StrCat("module_id ", module_id, " is not a module"));
    }
    if (moved) {
      const uint64_t n = ++moved_count_;
      moved_[module_id] = {it->second->tenant, n};
      moved_order_.emplace_back(module_id, n);
      while (moved_order_.size() > kMovedRemembered) {
        const auto& [id, number] = moved_order_.front();
        // Only its latest entry forgets it: a module that moved twice stays remembered.
        if (auto m = moved_.find(id); m != moved_.end() && m->second.second == number) {
          moved_.erase(m);
        }
        moved_order_.pop_front();
      }
    }
    modules_.erase(it);
  }
  contexts_.ReleaseModule(module_id, moved);
  return absl::OkStatus();
}

int64_t ModuleRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int64_t(modules_.size());
}

}  // namespace gradwire::core
