#include "server/core/contexts/context_store.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "server/core/contexts/offload.h"

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

namespace {

absl::Status Unknown(const std::string& context_id) {
  return absl::NotFoundError(absl::StrCat("context_id ", context_id, " is not a live context"));
}

}  // namespace

ContextStore::ContextStore(ContextLimits limits, Clock clock)
    : limits_(limits), clock_(std::move(clock)) {
  gone_.reserve(kGoneMemory);
  gone_ring_.reserve(kGoneMemory);
}

std::optional<ContextStore::IdBits> ContextStore::ParseId(const std::string& context_id) {
  if (context_id.size() != 32) return std::nullopt;
  IdBits bits;
  for (size_t i = 0; i < 32; ++i) {
    const char c = context_id[i];
    uint64_t v;
    if (c >= '0' && c <= '9') {
      v = uint64_t(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v = uint64_t(c - 'a' + 10);
    } else {
      return std::nullopt;
    }
    uint64_t& half = i < 16 ? bits.hi : bits.lo;
    half = (half << 4) | v;
  }
  return bits;
}

const ContextStore::GoneEntry* ContextStore::FindGoneLocked(const std::string& context_id) const {
  const std::optional<IdBits> bits = ParseId(context_id);
  if (!bits) return nullptr;
  auto it = gone_.find(*bits);
  return it == gone_.end() ? nullptr : &it->second;
}

void ContextStore::RememberGoneLocked(const std::string& context_id, const std::string& tenant,
                                      Gone why) {
  const std::optional<IdBits> bits = ParseId(context_id);
  if (!bits) return;  // not an id this store made
  auto [t, added] = tenant_index_.emplace(tenant, uint32_t(tenants_.size()));
  if (added) tenants_.push_back(tenant);
  if (gone_ring_.size() < kGoneMemory) {
    gone_ring_.push_back(*bits);
  } else {  // forget the oldest
    gone_.erase(gone_ring_[gone_next_]);
    gone_ring_[gone_next_] = *bits;
    gone_next_ = (gone_next_ + 1) % kGoneMemory;
  }
  gone_[*bits] = GoneEntry{t->second, why};
}

ContextStore::~ContextStore() = default;

std::chrono::steady_clock::time_point ContextStore::Now() const {
  return clock_ ? clock_() : std::chrono::steady_clock::now();
}

absl::Status ContextStore::CheckFits(int64_t bytes) {
  absl::Status s = FitsStatus(bytes);
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.rejected_too_large;
  }
  return s;
}

absl::Status ContextStore::FitsStatus(int64_t bytes) const {
  if (bytes > limits_.device_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this forward's saved tensors take ", bytes,
                     " bytes, more than the whole context memory budget (--context-memory ",
                     limits_.device_bytes, " bytes); send fewer rows per call"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ContextStore::Put(std::string module_id, uint64_t weight_version,
                                              std::shared_ptr<SavedTensors> saved,
                                              std::string tenant, std::string client,
                                              std::string id) {
  const int64_t bytes = saved->bytes();
  std::lock_guard<std::mutex> lock(mu_);
  if (!id.empty() && (entries_.count(id) || FindGoneLocked(id) != nullptr)) {
    return absl::AlreadyExistsError(
        absl::StrCat("context_id ", id, " is or was a context already: draw another"));
  }
  if (auto s = FitsStatus(bytes); !s.ok()) {
    ++stats_.rejected_too_large;
    return s;
  }
  EvictExpiredLocked();
  if (limits_.client_bytes > 0) {
    auto c = per_client_.find(client);
    const int64_t held = c == per_client_.end() ? 0 : c->second.bytes;
    if (held + bytes > limits_.client_bytes) {
      ++stats_.rejected_quota;
      return absl::ResourceExhaustedError(absl::StrCat(
          "this forward's saved tensors take ", bytes, " bytes and this client's live contexts ",
          held, " already, over the quota of ", limits_.client_bytes,
          " bytes (--max-context-bytes-per-client); run their backwards or release them first"));
    }
  }
  if (auto s = CheckShareLocked(tenant, bytes); !s.ok()) {
    ++stats_.rejected_share;
    return s;
  }
  while (id.empty() || entries_.count(id) || FindGoneLocked(id) != nullptr) id = RandomId128();
  Entry entry;
  entry.module_id = std::move(module_id);
  entry.tenant = std::move(tenant);
  entry.client = std::move(client);
  entry.weight_version = weight_version;
  entry.bytes = bytes;
  entry.client_bytes = bytes;
  entry.pin = saved->shared_key();
  if (entry.pin != nullptr) {
    Pin& pin = pins_[entry.pin];
    if (pin.contexts++ == 0) {
      pin.bytes = saved->shared_bytes();
      stats_.weight_bytes += pin.bytes;
    }
  }
  entry.saved = std::move(saved);
  ClientCount& count = per_client_[entry.client];
  ++count.contexts;
  count.bytes += bytes;
  ClientCount& tenant_count = per_tenant_[entry.tenant];
  ++tenant_count.contexts;
  tenant_count.bytes += bytes;
  {
    std::lock_guard<std::mutex> index_lock(index_mu_);
    index_.emplace(id, IndexEntry{entry.module_id, entry.tenant});
  }
  auto it = entries_.emplace(id, std::move(entry)).first;
  TouchLocked(it);
  stats_.device_bytes += bytes;
  // Older contexts make room first; the new one itself goes to host memory only when running
  // backwards hold the rest of the budget.
  if (!MakeDeviceRoomLocked(0, nullptr)) {
    spdlog::error("context store: device budget exceeded with every context in a backward");
  }
  EnforceHostLocked(nullptr);
  NotePeaksLocked();
  return id;
}

void ContextStore::TouchLocked(Iter it) {
  order_.erase(it->second.seq);
  it->second.seq = ++next_seq_;
  it->second.used = Now();
  order_.emplace(it->second.seq, it->first);
}

double ContextStore::WeightOf(const std::string& tenant) const {
  auto it = limits_.tenant_weights.find(tenant);
  return it == limits_.tenant_weights.end() ? 1.0 : it->second;
}

double ContextStore::ShareLocked(const std::string& tenant, const std::string* joining) const {
  double total_weight = 0;
  for (const auto& [name, count] : per_tenant_) total_weight += WeightOf(name);
  if (joining != nullptr && per_tenant_.count(*joining) == 0) total_weight += WeightOf(*joining);
  if (total_weight <= 0) return 0;
  return double(limits_.device_bytes + limits_.host_bytes) * WeightOf(tenant) / total_weight;
}

absl::Status ContextStore::CheckShareLocked(const std::string& tenant, int64_t bytes) const {
  bool others = false;
  int64_t live = 0, held = 0;
  for (const auto& [name, count] : per_tenant_) {
    live += count.bytes;
    if (name == tenant) {
      held = count.bytes;
    } else {
      others = true;
    }
  }
  const int64_t budget = limits_.device_bytes + limits_.host_bytes;
  if (!others || live + bytes <= budget) return absl::OkStatus();  // nobody would be evicted
  const double share = ShareLocked(tenant, &tenant);
  if (double(held + bytes) <= share) return absl::OkStatus();  // the others are over theirs
  return absl::ResourceExhaustedError(absl::StrCat(
      "context memory is full and this tenant's live contexts hold ", held,
      " bytes; with this forward's ", bytes, " they would be over its fair share of ",
      int64_t(share), " bytes (--context-memory plus --host-offload-memory, ", budget,
      " bytes, divided among the ", per_tenant_.size() + (per_tenant_.count(tenant) ? 0 : 1),
      " tenants holding contexts by weight), and another tenant's context would be evicted "
      "for it; run backwards or release contexts first"));
}

ContextStore::Iter ContextStore::PickVictimLocked(
    const std::function<bool(const Entry&)>& eligible) {
  if (per_tenant_.size() <= 1) {  // one tenant: least recently used first
    for (const auto& [seq, id] : order_) {
      auto it = entries_.find(id);
      if (eligible(it->second)) return it;
    }
    return entries_.end();
  }
  // Each tenant's least recently used eligible context; the tenant furthest over its share wins.
  std::unordered_map<std::string, Iter> first;
  for (const auto& [seq, id] : order_) {
    auto it = entries_.find(id);
    if (eligible(it->second)) first.emplace(it->second.tenant, it);
  }
  Iter best = entries_.end();
  double best_over = 0;
  for (const auto& [tenant, it] : first) {
    const double over = double(per_tenant_[tenant].bytes) - ShareLocked(tenant, nullptr);
    if (best == entries_.end() || over > best_over ||
        (over == best_over && it->second.seq < best->second.seq)) {
      best = it;
      best_over = over;
    }
  }
  return best;
}

bool ContextStore::MakeDeviceRoomLocked(int64_t need, const Entry* keep) {
  while (stats_.device_bytes + need > limits_.device_bytes) {
    auto it = PickVictimLocked(
        [keep](const Entry& e) { return &e != keep && !e.in_backward && !e.pack; });
    if (it == entries_.end()) break;
    Entry& e = it->second;
    if (e.bytes > limits_.host_bytes) {  // it could not stay on the host: no copy for nothing
      stats_.device_bytes -= e.bytes;
      e.bytes = 0;
      EraseLocked(it, /*remember=*/true, Gone::kEvictedMemory);
      ++stats_.evicted_memory;
      continue;
    }
    auto pack = HostPack::Pack(*e.saved);
    stats_.device_bytes -= e.bytes;
    if (!pack.ok()) {  // no host memory at all: the context cannot be kept
      spdlog::warn("context {} evicted: {}", it->first, std::string(pack.status().message()));
      e.bytes = 0;
      EraseLocked(it, /*remember=*/true, Gone::kEvictedMemory);
      ++stats_.evicted_memory;
      continue;
    }
    e.pack = *std::move(pack);
    stats_.host_bytes += e.pack->bytes();
    ++stats_.offloads;
  }
  return stats_.device_bytes + need <= limits_.device_bytes;
}

void ContextStore::EnforceHostLocked(const Entry* keep) {
  while (stats_.host_bytes > limits_.host_bytes) {
    auto it = PickVictimLocked([keep](const Entry& e) { return e.pack && &e != keep; });
    if (it == entries_.end()) break;
    EraseLocked(it, /*remember=*/true, Gone::kEvictedMemory);
    ++stats_.evicted_memory;
  }
}

void ContextStore::EvictExpiredLocked() {
  if (limits_.ttl_seconds <= 0) return;
  const auto now = Now();
  const auto ttl = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(limits_.ttl_seconds));
  for (auto o = order_.begin(); o != order_.end();) {
    auto it = entries_.find(o->second);
    ++o;
    if (now - it->second.used < ttl) break;  // least recently used first: the rest are younger
    if (it->second.in_backward) continue;    // in use; its Finish renews it
    EraseLocked(it, /*remember=*/true, Gone::kEvictedTtl);
    ++stats_.evicted_ttl;
  }
}

int64_t ContextStore::EvictExpired() {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t before = stats_.evicted_ttl;
  EvictExpiredLocked();
  return stats_.evicted_ttl - before;
}

absl::Status ContextStore::GoneStatus(const std::string& context_id, Gone why) const {
  switch (why) {
    case Gone::kConsumed:
      return absl::FailedPreconditionError(absl::StrCat(
          "context_id ", context_id,
          " was already consumed by a backward; set retain=true on the first backward to run "
          "another"));
    case Gone::kEvictedTtl:
      return absl::NotFoundError(absl::StrCat(
          "context_id ", context_id, " was evicted: unused for longer than the context TTL (",
          limits_.ttl_seconds, " s, --context-ttl); run its forward again"));
    case Gone::kEvictedMemory:
      return absl::NotFoundError(
          absl::StrCat("context_id ", context_id,
                       " was evicted: context memory was full (device and host offload budgets, "
                       "--context-memory ",
                       limits_.device_bytes, " and --host-offload-memory ", limits_.host_bytes,
                       " bytes); run its forward again"));
    case Gone::kUndelivered:
      return absl::NotFoundError(absl::StrCat(
          "context_id ", context_id,
          " was released: the response of the forward that made it never reached the client "
          "(cancelled, past its deadline or disconnected), so the server dropped it; run the "
          "forward again"));
    case Gone::kStreamEnded:
      return absl::NotFoundError(absl::StrCat(
          "context_id ", context_id,
          " was released when the Train stream that made it ended; a stream's contexts last only "
          "as long as the stream"));
    case Gone::kModuleMoved:
      return absl::NotFoundError(absl::StrCat(
          "context_id ", context_id,
          " was released: its module moved to another server (another server sharing the "
          "checkpoint directory took it over), and contexts do not move with their module; run "
          "the forward again"));
  }
  return Unknown(context_id);
}

absl::Status ContextStore::CheckTenant(const std::string& context_id,
                                       const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string* owner = nullptr;
  if (auto it = entries_.find(context_id); it != entries_.end()) {
    owner = &it->second.tenant;
  } else if (const GoneEntry* g = FindGoneLocked(context_id)) {
    owner = &tenants_[g->tenant];
  }
  if (owner == nullptr || *owner != tenant) return Unknown(context_id);
  return absl::OkStatus();
}

absl::StatusOr<ContextStore::Lease> ContextStore::Acquire(const std::string& context_id) {
  std::lock_guard<std::mutex> lock(mu_);
  EvictExpiredLocked();
  auto it = entries_.find(context_id);
  if (it == entries_.end()) {
    if (const GoneEntry* g = FindGoneLocked(context_id)) {
      return GoneStatus(context_id, g->why);
    }
    return Unknown(context_id);
  }
  Entry& e = it->second;
  if (e.in_backward) {
    return absl::FailedPreconditionError(
        absl::StrCat("context_id ", context_id, " has a backward running"));
  }
  if (e.pack) {
    // A swap: this context's host bytes make room for the ones that leave the device for it.
    const int64_t packed = e.pack->bytes();
    stats_.host_bytes -= packed;
    const bool room = MakeDeviceRoomLocked(e.bytes, &e);
    absl::Status unpacked = absl::OkStatus();
    if (room) unpacked = e.pack->Unpack(*e.saved);
    if (!room || !unpacked.ok()) {  // it stays offloaded
      stats_.host_bytes += packed;
      EnforceHostLocked(&e);
      NotePeaksLocked();
      if (!unpacked.ok()) return unpacked;
      return absl::ResourceExhaustedError(
          absl::StrCat("context_id ", context_id,
                       " is offloaded and running backwards hold the whole context memory budget "
                       "(--context-memory ",
                       limits_.device_bytes, " bytes); retry"));
    }
    e.pack.reset();
    stats_.device_bytes += e.bytes;
    EnforceHostLocked(&e);
    NotePeaksLocked();
    ++stats_.restores;
  }
  e.in_backward = true;
  return Lease{e.module_id, e.weight_version, e.saved};
}

void ContextStore::Finish(const std::string& context_id, bool consumed, bool retain) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(context_id);
  if (it == entries_.end()) return;
  it->second.in_backward = false;
  if (consumed && !retain) {
    EraseLocked(it, /*remember=*/true, Gone::kConsumed);
    return;
  }
  TouchLocked(it);
  // Offloads skipped this context while its backward ran.
  MakeDeviceRoomLocked(0, nullptr);
  EnforceHostLocked(nullptr);
  NotePeaksLocked();
}

void ContextStore::NotePeaksLocked() {
  stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, stats_.device_bytes);
  stats_.peak_host_bytes = std::max(stats_.peak_host_bytes, stats_.host_bytes);
  stats_.peak_weight_bytes = std::max(stats_.peak_weight_bytes, stats_.weight_bytes);
}

absl::Status ContextStore::Release(const std::string& context_id, ReleaseReason reason) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(context_id);
  if (it == entries_.end()) {
    if (FindGoneLocked(context_id) != nullptr) return absl::OkStatus();
    return Unknown(context_id);
  }
  if (it->second.in_backward) {
    return absl::FailedPreconditionError(
        absl::StrCat("context_id ", context_id, " has a backward running"));
  }
  EraseLocked(it, /*remember=*/true,
              reason == ReleaseReason::kUndelivered   ? Gone::kUndelivered
              : reason == ReleaseReason::kStreamEnded ? Gone::kStreamEnded
                                                      : Gone::kConsumed);
  return absl::OkStatus();
}

int64_t ContextStore::ReleaseModule(const std::string& module_id, bool moved) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t released = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (it->second.module_id == module_id) {
      EraseLocked(it, /*remember=*/moved, moved ? Gone::kModuleMoved : Gone::kConsumed);
      ++released;
    }
    it = next;
  }
  return released;
}

void ContextStore::EraseLocked(Iter it, bool remember, Gone why) {
  Entry& e = it->second;
  if (e.pack) {
    stats_.host_bytes -= e.pack->bytes();
  } else {
    stats_.device_bytes -= e.bytes;
  }
  if (auto c = per_client_.find(e.client); c != per_client_.end()) {
    c->second.bytes -= e.client_bytes;
    if (--c->second.contexts <= 0) per_client_.erase(c);
  }
  if (auto t = per_tenant_.find(e.tenant); t != per_tenant_.end()) {
    t->second.bytes -= e.client_bytes;
    if (--t->second.contexts <= 0) per_tenant_.erase(t);
  }
  if (e.pin != nullptr) {
    if (auto p = pins_.find(e.pin); p != pins_.end() && --p->second.contexts <= 0) {
      stats_.weight_bytes -= p->second.bytes;
      pins_.erase(p);
    }
  }
  order_.erase(e.seq);
  if (remember) RememberGoneLocked(it->first, e.tenant, why);
  {
    std::lock_guard<std::mutex> index_lock(index_mu_);
    index_.erase(it->first);
  }
  entries_.erase(it);
}

int64_t ContextStore::live_contexts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int64_t(entries_.size());
}

int64_t ContextStore::live_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_.device_bytes + stats_.host_bytes;
}

int64_t ContextStore::live_contexts(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t count = 0;
  for (const auto& [id, entry] : entries_) count += entry.module_id == module_id;
  return count;
}

int64_t ContextStore::live_contexts_of_client(const std::string& client) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = per_client_.find(client);
  return it == per_client_.end() ? 0 : it->second.contexts;
}

int64_t ContextStore::live_bytes_of_client(const std::string& client) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = per_client_.find(client);
  return it == per_client_.end() ? 0 : it->second.bytes;
}

std::unordered_map<std::string, int64_t> ContextStore::live_bytes_by_client() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::unordered_map<std::string, int64_t> out;
  for (const auto& [client, count] : per_client_) out.emplace(client, count.bytes);
  return out;
}

std::unordered_map<std::string, int64_t> ContextStore::live_bytes_by_tenant() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::unordered_map<std::string, int64_t> out;
  for (const auto& [tenant, count] : per_tenant_) out.emplace(tenant, count.bytes);
  return out;
}

int64_t ContextStore::fair_share_of(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  return int64_t(ShareLocked(tenant, &tenant));
}

bool ContextStore::Known(const std::string& context_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.count(context_id) != 0 || FindGoneLocked(context_id) != nullptr;
}

std::string ContextStore::ModuleOf(const std::string& context_id, const std::string* tenant) const {
  std::lock_guard<std::mutex> lock(index_mu_);
  auto it = index_.find(context_id);
  if (it == index_.end() || (tenant != nullptr && it->second.tenant != *tenant)) return {};
  return it->second.module_id;
}

ContextStats ContextStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ContextStats s = stats_;
  s.live = int64_t(entries_.size());
  s.pinned_weights = int64_t(pins_.size());
  for (const auto& [id, entry] : entries_) s.offloaded += entry.pack != nullptr;
  return s;
}

ContextStore::Residence ContextStore::Locate(const std::string& context_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(context_id);
  if (it == entries_.end()) return Residence::kNone;
  return it->second.pack ? Residence::kHost : Residence::kDevice;
}

std::weak_ptr<SavedTensors> ContextStore::Peek(const std::string& context_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(context_id);
  return it == entries_.end() ? std::weak_ptr<SavedTensors>() : it->second.saved;
}

}  // namespace gradwire::core
