// The module registry: which modules exist, under which ids, owned by which tenant, and their
// leases (--module-ttl): when a call of the module's owner last succeeded on each. Transport-free
// and thread-safe; the modules themselves (module.h) have their own locks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/contexts/context_store.h"
#include "server/core/host_types.h"
#include "server/core/module_spec.h"

namespace gradwire::device {
class Backend;
}  // namespace gradwire::device

namespace gradwire::core {

using device::Backend;
struct Module;

class ModuleRegistry {
 public:
  // Modules compute on `backend`; a module's contexts live in `contexts` (released with it);
  // `clock` (tests) replaces the steady clock for lifetimes.
  ModuleRegistry(const Backend& backend, ContextStore& contexts, ContextStore::Clock clock);

  // A new module of `spec` (validated, parameters initialised from its seed) owned by `tenant`,
  // under `id` (ALREADY_EXISTS when a module has it), or under a fresh random id when `id` is
  // empty. The caller has checked the id's form.
  absl::StatusOr<ModuleInfo> Create(const ModuleSpec& spec, const std::string& tenant,
                                    const std::string& id = {});
  // Registers a module built elsewhere (a checkpoint's) under `id`; ALREADY_EXISTS when taken.
  absl::Status Insert(const std::string& id, std::shared_ptr<Module> module);
  // The module; NOT_FOUND naming the id, or the moved refusal (IsModuleMoved) for one that was
  // deleted as moved. A lookup renews nothing: whoever asks, and whatever
  // the call that asked meets later.
  absl::StatusOr<std::shared_ptr<Module>> Find(const std::string& module_id) const;
  // Starts the module's lease again. The parts call it when a call on the module succeeded (a
  // forward, a backward, a step, a weights call): the rpc layer reaches them only for the module's
  // owner, after its checks.
  void Renew(const Module& module) const;
  // Find, then Renew (a keep-alive of the module's owner).
  absl::Status Touch(const std::string& module_id) const;

  absl::StatusOr<ModuleInfo> Info(const std::string& module_id) const;
  absl::StatusOr<ModuleSpec> Spec(const std::string& module_id) const;
  std::vector<ModuleInfo> List(const std::string* tenant) const;
  // NOT_FOUND, worded exactly as for an unknown id, unless the module belongs to `tenant`; the
  // moved refusal for a module of `tenant`'s that was deleted as moved.
  absl::Status CheckTenant(const std::string& module_id, const std::string& tenant) const;
  // Removes the module and releases its contexts. `moved`: another server holds it now. Its
  // contexts are then told so, and so is a call about it that was admitted before (queued, say)
  // and looks it up after: its id is remembered, with its tenant, among the last kMovedRemembered,
  // until a module of that id is here again.
  absl::Status Delete(const std::string& module_id, bool moved = false);
  static constexpr size_t kMovedRemembered = 4096;
  // Whether a module has the id, without renewing it.
  bool Has(const std::string& module_id) const;
  // Removes, with their contexts, the modules whose lease was not renewed for `ttl_s` seconds;
  // their ids. A module a call holds now (found and not yet let go of) or that `busy` names (calls
  // queued for it) stays: it expires later, unless that call's success renews it.
  using Busy = std::function<bool(const std::string& module_id)>;
  std::vector<std::string> ExpireIdle(double ttl_s, const Busy& busy = nullptr);

  int64_t size() const;
  int64_t expired() const { return expired_.load(); }

 private:
  ModuleInfo InfoLocked(const std::string& id, const Module& m) const;
  int64_t NowNs() const;
  // An id no module has: the moved refusal when it was deleted as moved (and `tenant`, when given,
  // owned it), NOT_FOUND otherwise. Under mu_.
  absl::Status MissingLocked(const std::string& module_id, const std::string* tenant) const;
  // A module of the id is here (again): it is no longer remembered as moved. Under mu_.
  void ArrivedLocked(const std::string& module_id) { moved_.erase(module_id); }

  const Backend& backend_;
  ContextStore& contexts_;
  ContextStore::Clock clock_;  // null: the steady clock
  std::atomic<int64_t> expired_{0};
  mutable std::mutex mu_;  // guards modules_, moved_ and moved_order_
  std::map<std::string, std::shared_ptr<Module>> modules_;
  // Modules deleted as moved: id -> (tenant, the number of its entry in moved_order_), the oldest
  // first out once there are kMovedRemembered.
  std::map<std::string, std::pair<std::string, uint64_t>> moved_;
  std::deque<std::pair<std::string, uint64_t>> moved_order_;
  uint64_t moved_count_ = 0;
};

}  // namespace gradwire::core
