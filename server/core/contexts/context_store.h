// Saved tensors of training forwards, kept from Forward until the matching Backward (or
// ReleaseContext) and not one moment longer, within memory budgets (DESIGN.md, bounded memory):
//   - device budget: past it, the saved tensors of the least recently used contexts move to host
//     memory (HostPack) and come back when their backward arrives;
//   - host budget: past it, the least recently used offloaded contexts are evicted;
//   - TTL: a context unused for longer is evicted, so abandoned contexts never leak.
// A backward on an evicted context gets NOT_FOUND that says it was evicted and why.
//
// Fair shares between tenants: the two budgets together are divided among the tenants holding
// contexts, by weight (ContextLimits::tenant_weights). What leaves the device, and what is
// evicted, is taken from the tenant furthest over its share (its least recently used context
// first), so a tenant within its share never loses a context to another tenant. A forward that
// would need an eviction from a tenant already over its share, while another tenant holds
// contexts, is refused (RESOURCE_EXHAUSTED) instead of evicting anyone. With one tenant this is
// plain least-recently-used order.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/kinds/saved_tensors.h"

namespace gradwire::core {

class HostPack;

struct ContextLimits {
  // Bytes of saved tensors kept on the device. A single context larger than this is refused
  // (RESOURCE_EXHAUSTED): it could never be restored for its backward.
  int64_t device_bytes = int64_t(4) << 30;
  // Bytes of offloaded saved tensors kept in host memory; 0: no offload, past the device budget
  // the least recently used contexts are evicted.
  int64_t host_bytes = int64_t(8) << 30;
  // Seconds a context may go unused (since its forward or its last backward) before it is
  // evicted; <= 0: never.
  double ttl_seconds = 600;
  // Saved-tensor bytes (device and host together) one client's live contexts may hold; a forward
  // that would go past it is refused (RESOURCE_EXHAUSTED naming
  // --max-context-bytes-per-client) and stores nothing. 0: unlimited.
  int64_t client_bytes = 0;
  // Each tenant's weight in the fair shares (the tokens file's third column); a tenant not
  // listed weighs 1.
  std::unordered_map<std::string, double> tenant_weights = {};
};

// Counters of the store, for metrics and GetServerInfo.
struct ContextStats {
  int64_t live = 0;          // contexts waiting for a backward (on device or host)
  int64_t offloaded = 0;     // of those, how many are in host memory now
  int64_t device_bytes = 0;  // saved-tensor bytes on the device
  int64_t host_bytes = 0;    // saved-tensor bytes offloaded to host memory
  int64_t peak_device_bytes = 0;
  int64_t peak_host_bytes = 0;
  int64_t offloads = 0;            // device -> host moves
  int64_t restores = 0;            // host -> device moves (a backward on an offloaded context)
  int64_t evicted_ttl = 0;         // contexts evicted for being unused past the TTL
  int64_t evicted_memory = 0;      // contexts evicted because the host budget was full
  int64_t rejected_too_large = 0;  // forwards whose context alone exceeded the device budget
  int64_t rejected_quota = 0;      // forwards refused by --max-context-bytes-per-client
  int64_t rejected_share = 0;      // forwards refused: their tenant over its fair share
  // Weight versions kept alive by live contexts (SavedTensors::shared_key), each counted once,
  // and their bytes. Reported beside the saved tensors; not part of the budgets above.
  int64_t pinned_weights = 0;
  int64_t weight_bytes = 0;
  int64_t peak_weight_bytes = 0;
};

class ContextStore {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;

  // How many consumed or evicted ids are remembered, so a second backward gets
  // FAILED_PRECONDITION (or NOT_FOUND saying "evicted") rather than the unknown-id NOT_FOUND.
  static constexpr size_t kGoneMemory = 1 << 16;

  // `clock` (tests) replaces the steady clock for the TTL.
  explicit ContextStore(ContextLimits limits = {}, Clock clock = nullptr);
  ~ContextStore();
  ContextStore(const ContextStore&) = delete;
  ContextStore& operator=(const ContextStore&) = delete;

  // A context checked out for a backward. Keep it no longer than the backward runs.
  struct Lease {
    std::string module_id;
    uint64_t weight_version = 0;
    std::shared_ptr<SavedTensors> saved;
  };

  // Where a context's saved tensors are.
  enum class Residence { kNone, kDevice, kHost };

  // RESOURCE_EXHAUSTED when a context of `bytes` could never fit the device budget (counted in
  // rejected_too_large).
  absl::Status CheckFits(int64_t bytes);
  // Whether a context of `bytes` could fit the device budget, counting nothing.
  bool Fits(int64_t bytes) const { return FitsStatus(bytes).ok(); }

  // Stores `saved` under `id`, or a fresh random 128-bit id (32 hex digits) when `id` is empty,
  // and returns the id, moving older contexts to host memory (and evicting) as the budgets
  // require. `tenant` owns the context (the module's tenant; see CheckTenant); `client` is who
  // made it, for live_contexts_of_client. RESOURCE_EXHAUSTED (nothing stored) when CheckFits
  // fails; ALREADY_EXISTS (nothing stored) when `id` is Known.
  absl::StatusOr<std::string> Put(std::string module_id, uint64_t weight_version,
                                  std::shared_ptr<SavedTensors> saved, std::string tenant = {},
                                  std::string client = {}, std::string id = {});
  // Whether `context_id` is live, or was and has been consumed, released or evicted (remembered
  // for the report of a later call on it): an id Put refuses.
  bool Known(const std::string& context_id) const;

  // NOT_FOUND, worded exactly as for an unknown id, unless `context_id` is a live, consumed or
  // evicted context of `tenant`: another tenant learns nothing about the id.
  absl::Status CheckTenant(const std::string& context_id, const std::string& tenant) const;

  // Checks a context out for a backward, bringing it back from host memory when it was offloaded.
  // NOT_FOUND for an unknown id, and NOT_FOUND saying "evicted" and why for an evicted one;
  // FAILED_PRECONDITION when it was consumed already or another backward on it is running;
  // RESOURCE_EXHAUSTED (the context stays offloaded) when running backwards hold the whole device
  // budget.
  absl::StatusOr<Lease> Acquire(const std::string& context_id);

  // Ends a backward started by Acquire.
  //   consumed=true:  the backward succeeded; without retain the context is erased now (drop the
  //                   lease's `saved` right after, it is then the last reference) and its id is
  //                   remembered as consumed.
  //   consumed=false: the backward failed; the context stays (on the device).
  void Finish(const std::string& context_id, bool consumed, bool retain);

  // Why a context is dropped without a backward; a later backward on it is told which.
  enum class ReleaseReason {
    kByClient,     // ReleaseContext: later backwards get FAILED_PRECONDITION, as if consumed
    kUndelivered,  // the forward's response never reached the client: NOT_FOUND saying so
    kStreamEnded,  // the Train stream that made it ended first: NOT_FOUND saying so
  };

  // Drops a context without a backward. NOT_FOUND for an unknown id; OK for a consumed or evicted
  // one; FAILED_PRECONDITION while a backward on it runs.
  absl::Status Release(const std::string& context_id,
                       ReleaseReason reason = ReleaseReason::kByClient);

  // Drops every context of a module (when the module is deleted, or `moved`: another server holds
  // it now, and a later backward on one of them is told so); returns how many.
  int64_t ReleaseModule(const std::string& module_id, bool moved = false);

  // Evicts the contexts past the TTL now (the store also does so on every Put and Acquire);
  // returns how many.
  int64_t EvictExpired();

  int64_t live_contexts() const;
  int64_t live_bytes() const;  // device + host
  int64_t live_contexts(const std::string& module_id) const;
  int64_t live_contexts_of_client(const std::string& client) const;
  // Saved-tensor bytes of a client's live contexts (as stored, wherever they are now), and every
  // client's (metrics).
  int64_t live_bytes_of_client(const std::string& client) const;
  std::unordered_map<std::string, int64_t> live_bytes_by_client() const;
  // Saved-tensor bytes of each tenant's live contexts, and each tenant's fair share of the two
  // budgets now (among the tenants holding contexts), for metrics and tests.
  std::unordered_map<std::string, int64_t> live_bytes_by_tenant() const;
  int64_t fair_share_of(const std::string& tenant) const;
  // The module a live context belongs to (of `tenant` when given); empty when there is none.
  // Reads only the live-context index, whose lock is never held across an offload copy or an
  // eviction: safe on gRPC reactor threads, which must not wait behind memory moves.
  std::string ModuleOf(const std::string& context_id, const std::string* tenant = nullptr) const;
  ContextStats stats() const;
  const ContextLimits& limits() const { return limits_; }

  // For tests: where a context is, and a weak handle on its saved tensors, to prove they were
  // freed.
  Residence Locate(const std::string& context_id) const;
  std::weak_ptr<SavedTensors> Peek(const std::string& context_id) const;

 private:
  enum class Gone {
    kConsumed,
    kEvictedTtl,
    kEvictedMemory,
    kUndelivered,
    kStreamEnded,
    kModuleMoved
  };
  struct Entry {
    std::string module_id;
    std::string tenant;
    std::string client;
    uint64_t weight_version = 0;
    std::shared_ptr<SavedTensors> saved;  // its tensors are undefined while `pack` holds them
    std::unique_ptr<HostPack> pack;       // set while offloaded
    const void* pin = nullptr;            // saved->shared_key(), counted in pins_
    int64_t bytes = 0;                    // device bytes when resident
    int64_t client_bytes = 0;             // what it counts against its client's quota (fixed)
    bool in_backward = false;
    uint64_t seq = 0;  // position in order_
    std::chrono::steady_clock::time_point used;
  };
  using Iter = std::unordered_map<std::string, Entry>::iterator;

  absl::Status FitsStatus(int64_t bytes) const;
  std::chrono::steady_clock::time_point Now() const;
  void TouchLocked(Iter it);
  // The next context to offload or evict among those `eligible` allows: the least recently used
  // one of the tenant furthest over its fair share. entries_.end() when none is eligible.
  Iter PickVictimLocked(const std::function<bool(const Entry&)>& eligible);
  double WeightOf(const std::string& tenant) const;
  // A tenant's fair share of the two budgets, among the tenants holding contexts and `joining`
  // (a tenant about to hold one; may be null).
  double ShareLocked(const std::string& tenant, const std::string* joining) const;
  // RESOURCE_EXHAUSTED when storing `bytes` more for `tenant` would need an eviction while the
  // tenant is over its share and another tenant holds contexts.
  absl::Status CheckShareLocked(const std::string& tenant, int64_t bytes) const;
  // Offloads contexts (never `keep`, never one in a backward; PickVictimLocked's order) until
  // `need` more bytes fit the device budget; false when they cannot.
  bool MakeDeviceRoomLocked(int64_t need, const Entry* keep);
  // Evicts offloaded contexts (never `keep`; PickVictimLocked's order) until the host budget
  // holds.
  void EnforceHostLocked(const Entry* keep);
  // The budgets hold between public calls (within one, a swap may pass through more); peaks are
  // taken there.
  void NotePeaksLocked();
  void EvictExpiredLocked();
  void EraseLocked(Iter it, bool remember, Gone why);
  absl::Status GoneStatus(const std::string& context_id, Gone why) const;

  const ContextLimits limits_;
  const Clock clock_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> entries_;
  std::map<uint64_t, std::string> order_;  // least recently used first
  uint64_t next_seq_ = 0;
  struct ClientCount {
    int64_t contexts = 0;
    int64_t bytes = 0;
  };
  std::unordered_map<std::string, ClientCount> per_client_;
  std::unordered_map<std::string, ClientCount> per_tenant_;  // only tenants holding contexts
  struct Pin {
    int64_t contexts = 0;
    int64_t bytes = 0;
  };
  // Shared state held by live contexts, by address (an entry holds it, so the address cannot be
  // reused while it is here).
  std::unordered_map<const void*, Pin> pins_;
  // Consumed and evicted ids, remembered compactly: their 128 bits (ids the store made are 32 hex
  // digits) and their tenant as an index into tenants_. About 70 bytes an id, allocated up front
  // except for the map's nodes, so a busy server's memory does not creep up as it fills.
  struct IdBits {
    uint64_t hi = 0, lo = 0;
    bool operator==(const IdBits& o) const { return hi == o.hi && lo == o.lo; }
  };
  struct IdBitsHash {
    size_t operator()(const IdBits& k) const {
      return size_t(k.hi ^ (k.lo * 0x9e3779b97f4a7c15ULL));
    }
  };
  struct GoneEntry {
    uint32_t tenant = 0;
    Gone why = Gone::kConsumed;
  };
  // The id's bits; nullopt when `context_id` is not 32 lowercase hex digits (never one of ours).
  static std::optional<IdBits> ParseId(const std::string& context_id);
  const GoneEntry* FindGoneLocked(const std::string& context_id) const;
  void RememberGoneLocked(const std::string& context_id, const std::string& tenant, Gone why);
  std::unordered_map<IdBits, GoneEntry, IdBitsHash> gone_;
  std::vector<IdBits> gone_ring_;  // kGoneMemory slots, oldest at gone_next_ once full
  size_t gone_next_ = 0;
  std::vector<std::string> tenants_;  // tenants seen, by index
  std::unordered_map<std::string, uint32_t> tenant_index_;
  ContextStats stats_;  // live and offloaded are computed on demand

  // Live contexts' module and tenant, for ModuleOf. Written under mu_ (then index_mu_; never the
  // other order), read under index_mu_ alone.
  struct IndexEntry {
    std::string module_id;
    std::string tenant;
  };
  mutable std::mutex index_mu_;
  std::unordered_map<std::string, IndexEntry> index_;
};

// A random 128-bit identifier as 32 lowercase hex digits.
std::string RandomId128();

}  // namespace gradwire::core
