// The context store on its own: ids, byte accounting, states, and the memory budgets: offload to
// host memory and back, eviction past the host budget and the TTL, oversized contexts, and
// backwards racing evictions.
#include "server/core/contexts/context_store.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cctype>
#include <condition_variable>
#include <future>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace gradwire::core {
namespace {

using Residence = ContextStore::Residence;

// A context owning one real uint8 tensor of `b` random bytes (and an undefined one, as modules
// have), so offload moves real memory; `original` keeps a copy to check what comes back.
struct FakeSaved final : SavedTensors {
  explicit FakeSaved(int64_t b)
      : data(at::randint(0, 256, {b}, at::TensorOptions().dtype(at::kByte))),
        original(data.clone()) {}
  int64_t bytes() const override { return data.defined() ? data.numel() : 0; }
  void ForEachTensor(const std::function<void(at::Tensor&)>& fn) override {
    fn(data);
    fn(absent);
  }
  bool Intact() const { return data.defined() && at::equal(data, original); }
  at::Tensor data, absent, original;
};

std::shared_ptr<FakeSaved> Saved(int64_t b) { return std::make_shared<FakeSaved>(b); }

std::string MustPut(ContextStore& store, int64_t bytes, const std::string& tenant = {},
                    const std::string& client = {}) {
  auto id = store.Put("m", 1, Saved(bytes), tenant, client);
  EXPECT_TRUE(id.ok()) << id.status();
  return id.ok() ? *id : std::string();
}

bool Contains(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

TEST(ContextStoreTest, IdsAreUnique128BitHex) {
  std::set<std::string> ids;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = RandomId128();
    ASSERT_EQ(id.size(), 32u);
    ASSERT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos);
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 1000u);
}

TEST(ContextStoreTest, BytesFollowPutFinishAndRelease) {
  ContextStore store;
  const std::string a = MustPut(store, 100);
  const std::string b = MustPut(store, 23);
  auto put_c = store.Put("n", 1, Saved(7));
  ASSERT_TRUE(put_c.ok());
  const std::string c = *put_c;
  EXPECT_EQ(store.live_bytes(), 130);
  EXPECT_EQ(store.live_contexts("m"), 2);
  auto lease = store.Acquire(a);
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->module_id, "m");
  // A second backward while the first runs is refused.
  EXPECT_EQ(store.Acquire(a).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store.Release(a).code(), absl::StatusCode::kFailedPrecondition);
  // A failed backward puts the context back as it was.
  store.Finish(a, /*consumed=*/false, /*retain=*/false);
  EXPECT_EQ(store.live_bytes(), 130);
  lease = store.Acquire(a);
  ASSERT_TRUE(lease.ok());
  lease->saved.reset();
  store.Finish(a, /*consumed=*/true, /*retain=*/false);
  EXPECT_EQ(store.live_bytes(), 30);
  EXPECT_TRUE(store.Release(a).ok());  // releasing a consumed context is harmless
  EXPECT_TRUE(store.Release(b).ok());
  EXPECT_EQ(store.live_bytes(), 7);
  EXPECT_EQ(store.ReleaseModule("n"), 1);
  EXPECT_EQ(store.live_bytes(), 0);
  EXPECT_EQ(store.live_contexts(), 0);
  EXPECT_EQ(store.Acquire(c).status().code(), absl::StatusCode::kNotFound);
}

// A context that also pins shared state (as modules pin a weight version).
struct PinningSaved final : SavedTensors {
  PinningSaved(int64_t b, std::shared_ptr<const int64_t> shared_size)
      : data(at::randint(0, 256, {b}, at::TensorOptions().dtype(at::kByte))),
        shared(std::move(shared_size)) {}
  int64_t bytes() const override { return data.numel(); }
  void ForEachTensor(const std::function<void(at::Tensor&)>& fn) override { fn(data); }
  const void* shared_key() const override { return shared.get(); }
  int64_t shared_bytes() const override { return *shared; }
  at::Tensor data;
  std::shared_ptr<const int64_t> shared;
};

TEST(ContextStoreTest, SharedStateIsCountedOnceWhileAnyContextHoldsIt) {
  ContextStore store(ContextLimits{/*device_bytes=*/64, /*host_bytes=*/1 << 20, 0});
  auto v1 = std::make_shared<const int64_t>(1000);
  auto v2 = std::make_shared<const int64_t>(333);
  std::vector<std::string> ids;
  for (auto* v : {&v1, &v1, &v1, &v2}) {
    auto id = store.Put("m", 1, std::make_shared<PinningSaved>(40, *v));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  ContextStats s = store.stats();
  EXPECT_EQ(s.pinned_weights, 2);
  EXPECT_EQ(s.weight_bytes, 1333);
  EXPECT_EQ(s.peak_weight_bytes, 1333);
  // Shared state is outside the saved-tensor budgets: contexts offloaded past the 64-byte device
  // budget still pin it, and it is never offloaded.
  EXPECT_EQ(s.device_bytes + s.host_bytes, 160);
  EXPECT_GE(s.offloads, 2);
  // Consumed, released, evicted: the last context of a version unpins it.
  auto lease = store.Acquire(ids[0]);
  ASSERT_TRUE(lease.ok()) << lease.status();
  lease->saved.reset();
  store.Finish(ids[0], /*consumed=*/true, /*retain=*/false);
  ASSERT_TRUE(store.Release(ids[1]).ok());
  EXPECT_EQ(store.stats().weight_bytes, 1333);
  ASSERT_TRUE(store.Release(ids[2]).ok());
  s = store.stats();
  EXPECT_EQ(s.pinned_weights, 1);
  EXPECT_EQ(s.weight_bytes, 333);
  EXPECT_EQ(store.ReleaseModule("m"), 1);
  s = store.stats();
  EXPECT_EQ(s.pinned_weights, 0);
  EXPECT_EQ(s.weight_bytes, 0);
  EXPECT_EQ(s.peak_weight_bytes, 1333);
}

TEST(ContextStoreTest, AModuleLetGoAsMovedLeavesItsContextsSayingSo) {
  ContextStore store;
  const std::string moved = MustPut(store, 8, "alice");
  ASSERT_TRUE(store.Put("other", 1, Saved(8), "alice").ok());
  EXPECT_EQ(store.ReleaseModule("m", /*moved=*/true), 1);
  EXPECT_EQ(store.live_contexts(), 1);  // the other module's
  const absl::Status s = store.Acquire(moved).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s, "its module moved to another server")) << s;
  EXPECT_EQ(store.CheckTenant(moved, "bob").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.CheckTenant(moved, "alice").ok());
  // A deleted module's contexts are forgotten: they read as never made.
  const std::string deleted = MustPut(store, 8);
  EXPECT_EQ(store.ReleaseModule("m"), 1);
  EXPECT_FALSE(Contains(store.Acquire(deleted).status(), "moved"))
      << store.Acquire(deleted).status();
}

TEST(ContextStoreTest, RemembersTheLastConsumedIdsAndForgetsTheOldest) {
  ContextStore store;
  std::vector<std::string> ids;
  const size_t n = ContextStore::kGoneMemory + 10;
  auto saved = Saved(1);  // shared: the store does not care
  for (size_t i = 0; i < n; ++i) {
    auto id = store.Put("m", 1, saved, i % 2 ? "alice" : "bob");
    ASSERT_TRUE(id.ok());
    ASSERT_TRUE(store.Release(*id).ok());
    ids.push_back(*id);
  }
  EXPECT_EQ(store.live_contexts(), 0);
  // The 10 oldest are forgotten: an unknown id again.
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_TRUE(Contains(store.Acquire(ids[i]).status(), "is not a live context")) << i;
    EXPECT_EQ(store.Release(ids[i]).code(), absl::StatusCode::kNotFound);
  }
  // The rest are remembered as consumed, for their own tenant only.
  for (size_t i : {size_t(10), size_t(11), n / 2, n - 2, n - 1}) {
    EXPECT_EQ(store.Acquire(ids[i]).status().code(), absl::StatusCode::kFailedPrecondition) << i;
    EXPECT_TRUE(store.Release(ids[i]).ok());
    EXPECT_TRUE(store.CheckTenant(ids[i], i % 2 ? "alice" : "bob").ok()) << i;
    EXPECT_FALSE(store.CheckTenant(ids[i], i % 2 ? "bob" : "alice").ok()) << i;
  }
  // Ids that are not 32 lowercase hex digits are never remembered.
  std::string upper = ids.back();
  for (char& c : upper) c = char(std::toupper(c));
  if (upper != ids.back()) {
    EXPECT_TRUE(Contains(store.Acquire(upper).status(), "is not a live context"));
  }
}

TEST(ContextStoreTest, OldestContextsMoveToHostAndComeBackForTheirBackward) {
  constexpr int64_t kB = 1000;
  ContextStore store({/*device_bytes=*/3 * kB, /*host_bytes=*/10 * kB, /*ttl_seconds=*/0});
  std::vector<std::string> ids;
  std::vector<std::weak_ptr<SavedTensors>> saved;
  for (int i = 0; i < 5; ++i) {
    ids.push_back(MustPut(store, kB));
    saved.push_back(store.Peek(ids.back()));
    ASSERT_LE(store.stats().device_bytes, 3 * kB);
  }
  // The two oldest were packed into host memory: their device tensors are gone.
  EXPECT_EQ(store.Locate(ids[0]), Residence::kHost);
  EXPECT_EQ(store.Locate(ids[1]), Residence::kHost);
  for (int i = 2; i < 5; ++i) EXPECT_EQ(store.Locate(ids[i]), Residence::kDevice);
  EXPECT_FALSE(static_cast<FakeSaved&>(*saved[0].lock()).data.defined());
  ContextStats s = store.stats();
  EXPECT_EQ(s.live, 5);
  EXPECT_EQ(s.offloaded, 2);
  EXPECT_EQ(s.device_bytes, 3 * kB);
  EXPECT_EQ(s.host_bytes, 2 * kB);
  EXPECT_EQ(s.offloads, 2);
  EXPECT_EQ(s.restores, 0);
  EXPECT_EQ(store.live_bytes(), 5 * kB);

  // The backward of the oldest brings it back, byte for byte, and the least recently used
  // context on the device makes room.
  auto lease = store.Acquire(ids[0]);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(static_cast<FakeSaved&>(*lease->saved).Intact());
  EXPECT_EQ(store.Locate(ids[0]), Residence::kDevice);
  EXPECT_EQ(store.Locate(ids[2]), Residence::kHost);
  s = store.stats();
  EXPECT_EQ(s.restores, 1);
  EXPECT_EQ(s.offloads, 3);
  EXPECT_EQ(s.device_bytes, 3 * kB);
  EXPECT_EQ(s.host_bytes, 2 * kB);
  lease->saved.reset();
  store.Finish(ids[0], /*consumed=*/true, /*retain=*/false);
  EXPECT_TRUE(saved[0].expired());
  EXPECT_EQ(store.stats().device_bytes, 2 * kB);

  // Every other context survives its round trip intact.
  for (int i = 1; i < 5; ++i) {
    auto l = store.Acquire(ids[i]);
    ASSERT_TRUE(l.ok()) << i << ": " << l.status();
    EXPECT_TRUE(static_cast<FakeSaved&>(*l->saved).Intact()) << i;
    l->saved.reset();
    store.Finish(ids[i], true, false);
  }
  s = store.stats();
  EXPECT_EQ(s.live, 0);
  EXPECT_EQ(s.device_bytes, 0);
  EXPECT_EQ(s.host_bytes, 0);
  EXPECT_LE(s.peak_device_bytes, 3 * kB);
  EXPECT_EQ(s.evicted_memory + s.evicted_ttl, 0);
}

TEST(ContextStoreTest, PastTheHostBudgetTheOldestAreEvictedAndSaySo) {
  constexpr int64_t kB = 500;
  ContextStore store({2 * kB, 2 * kB, 0});
  std::vector<std::string> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(MustPut(store, kB, "alice"));
  EXPECT_EQ(store.Locate(ids[0]), Residence::kNone);
  EXPECT_EQ(store.Locate(ids[1]), Residence::kNone);
  EXPECT_EQ(store.Locate(ids[2]), Residence::kHost);
  EXPECT_EQ(store.Locate(ids[3]), Residence::kHost);
  EXPECT_EQ(store.Locate(ids[5]), Residence::kDevice);
  const ContextStats s = store.stats();
  EXPECT_EQ(s.evicted_memory, 2);
  EXPECT_EQ(s.evicted_ttl, 0);
  EXPECT_EQ(s.host_bytes, 2 * kB);
  EXPECT_LE(s.peak_host_bytes, 2 * kB);

  const absl::Status evicted = store.Acquire(ids[0]).status();
  EXPECT_EQ(evicted.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(evicted, "evicted")) << evicted;
  EXPECT_TRUE(Contains(evicted, "--host-offload-memory")) << evicted;
  // Unknown ids read differently...
  const std::string unknown = RandomId128();
  const absl::Status never = store.Acquire(unknown).status();
  EXPECT_EQ(never.code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(Contains(never, "evicted")) << never;
  // ...except to another tenant, who learns nothing: the evicted id reads as never-existed.
  EXPECT_TRUE(store.CheckTenant(ids[0], "alice").ok());
  const absl::Status other = store.CheckTenant(ids[0], "bob");
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(std::string(other.message()),
            std::string(store.CheckTenant(unknown, "bob").message())
                .replace(std::string("context_id ").size(), unknown.size(), ids[0]));
  // Releasing an evicted context is harmless; a second Acquire still says evicted.
  EXPECT_TRUE(store.Release(ids[1]).ok());
  EXPECT_TRUE(Contains(store.Acquire(ids[1]).status(), "evicted"));
}

TEST(ContextStoreTest, AHeavyTenantCannotEvictALightTenantsContext) {
  // Budgets of 16 + 16 units; tenant "a" holds one context, tenant "b" makes 40.
  constexpr int64_t kU = 1000;
  ContextStore store({16 * kU, 16 * kU, 0});
  const std::string a = MustPut(store, kU, "a");
  std::vector<std::string> b_ids;
  int refused = 0;
  for (int i = 0; i < 40; ++i) {
    auto id = store.Put("m", 1, Saved(kU), "b");
    if (id.ok()) {
      b_ids.push_back(*id);
      continue;
    }
    ++refused;
    EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(Contains(id.status(), "fair share")) << id.status();
  }
  // "b" fills what "a" leaves (31 units: past its share of 16, nobody needed evicting) and is
  // refused from then on; "a" keeps its context, on the device: "b" is offloaded first.
  EXPECT_EQ(b_ids.size(), 31u);
  EXPECT_EQ(refused, 9);
  EXPECT_EQ(store.Locate(a), Residence::kDevice);
  ContextStats s = store.stats();
  EXPECT_EQ(s.evicted_memory, 0);
  EXPECT_EQ(s.rejected_share, 9);
  EXPECT_EQ(store.fair_share_of("a"), 16 * kU);
  EXPECT_EQ(store.live_bytes_by_tenant().at("b"), 31 * kU);

  // "a" within its share still gets memory: each of its forwards evicts one of "b"'s contexts,
  // the least recently used first, and none of its own.
  std::vector<std::string> a_ids{a};
  for (int i = 0; i < 5; ++i) a_ids.push_back(MustPut(store, kU, "a"));
  s = store.stats();
  EXPECT_EQ(s.evicted_memory, 5);
  for (const std::string& id : a_ids) EXPECT_NE(store.Locate(id), Residence::kNone) << id;
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(store.Locate(b_ids[size_t(i)]), Residence::kNone) << i;
    EXPECT_TRUE(Contains(store.Acquire(b_ids[size_t(i)]).status(), "evicted"));
  }
  EXPECT_NE(store.Locate(b_ids[5]), Residence::kNone);
  auto lease = store.Acquire(a);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(static_cast<FakeSaved&>(*lease->saved).Intact());
  lease->saved.reset();
  store.Finish(a, true, false);
}

TEST(ContextStoreTest, FairSharesFollowTheTenantWeights) {
  constexpr int64_t kU = 1000;
  ContextLimits limits{8 * kU, 8 * kU, 0};
  limits.tenant_weights = {{"heavy", 3.0}};  // "light" weighs 1
  ContextStore store(limits);
  // Alone, a tenant's share is everything.
  EXPECT_EQ(store.fair_share_of("light"), 16 * kU);
  MustPut(store, kU, "heavy");
  EXPECT_EQ(store.fair_share_of("heavy"), 16 * kU);  // the only tenant holding contexts
  EXPECT_EQ(store.fair_share_of("light"), 4 * kU);   // were it to join
  // "light" may take what is free, then is refused once past its share of 4 units...
  int light = 0;
  while (store.Put("m", 1, Saved(kU), "light").ok()) ++light;
  EXPECT_EQ(light, 15);
  EXPECT_EQ(store.fair_share_of("heavy"), 12 * kU);
  // ...while "heavy", under its 12, evicts "light"'s contexts (the furthest over) for its own.
  for (int i = 0; i < 11; ++i) MustPut(store, kU, "heavy");
  EXPECT_EQ(store.live_bytes_by_tenant().at("heavy"), 12 * kU);
  EXPECT_EQ(store.live_bytes_by_tenant().at("light"), 4 * kU);
  EXPECT_EQ(store.stats().evicted_memory, 11);
  // Both at their shares: a further forward of either is refused, and nothing is evicted.
  EXPECT_EQ(store.Put("m", 1, Saved(kU), "heavy").status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store.Put("m", 1, Saved(kU), "light").status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store.stats().evicted_memory, 11);
}

TEST(ContextStoreTest, NoHostBudgetMeansEvictionInsteadOfOffload) {
  ContextStore store({1000, 0, 0});
  const std::string a = MustPut(store, 600);
  const std::string b = MustPut(store, 600);
  EXPECT_EQ(store.Locate(a), Residence::kNone);
  EXPECT_EQ(store.Locate(b), Residence::kDevice);
  EXPECT_EQ(store.stats().evicted_memory, 1);
  EXPECT_EQ(store.stats().host_bytes, 0);
  EXPECT_TRUE(Contains(store.Acquire(a).status(), "evicted"));
}

TEST(ContextStoreTest, UnusedContextsAreEvictedPastTheTtl) {
  auto now =
      std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
  ContextStore store({1 << 20, 1 << 20, /*ttl_seconds=*/10}, [now] { return *now; });
  const std::string a = MustPut(store, 64);
  const std::string b = MustPut(store, 64);
  const std::string c = MustPut(store, 64);
  *now += std::chrono::seconds(6);
  // A retained backward renews b; c is in a backward when the TTL passes.
  auto lb = store.Acquire(b);
  ASSERT_TRUE(lb.ok());
  lb->saved.reset();
  store.Finish(b, /*consumed=*/true, /*retain=*/true);
  auto lc = store.Acquire(c);
  ASSERT_TRUE(lc.ok());
  *now += std::chrono::seconds(5);  // a and c are 11 s old, b 5 s
  EXPECT_EQ(store.EvictExpired(), 1);
  EXPECT_EQ(store.Locate(a), Residence::kNone);
  EXPECT_EQ(store.Locate(b), Residence::kDevice);
  EXPECT_EQ(store.Locate(c), Residence::kDevice);  // in use: never evicted under a backward
  const absl::Status s = store.Acquire(a).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s, "evicted")) << s;
  EXPECT_TRUE(Contains(s, "--context-ttl")) << s;
  EXPECT_FALSE(Contains(s, "--host-offload-memory")) << s;
  store.Finish(c, /*consumed=*/false, false);  // renewed by its (failed) backward, at 11 s
  *now += std::chrono::seconds(3);             // 14 s: b unused for 8 s, c for 3 s
  EXPECT_EQ(store.EvictExpired(), 0);
  *now += std::chrono::seconds(3);  // 17 s: b 11 s, c 6 s; Put sweeps too
  MustPut(store, 64);
  EXPECT_EQ(store.Locate(b), Residence::kNone);
  EXPECT_EQ(store.Locate(c), Residence::kDevice);
  *now += std::chrono::seconds(5);  // 22 s: c 11 s, the new one 5 s
  EXPECT_EQ(store.EvictExpired(), 1);
  EXPECT_EQ(store.Locate(c), Residence::kNone);
  const ContextStats st = store.stats();
  EXPECT_EQ(st.evicted_ttl, 3);
  EXPECT_EQ(st.live, 1);
  EXPECT_EQ(st.device_bytes, 64);
}

TEST(ContextStoreTest, AContextLargerThanTheWholeBudgetIsRefusedAndNothingStored) {
  ContextStore store({1000, 1 << 20, 0});
  const std::string a = MustPut(store, 400);
  EXPECT_TRUE(store.CheckFits(1000).ok());
  const absl::Status fits = store.CheckFits(1001);
  EXPECT_EQ(fits.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(fits, "--context-memory")) << fits;
  auto big = store.Put("m", 1, Saved(1001));
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  const ContextStats s = store.stats();
  EXPECT_EQ(s.live, 1);
  EXPECT_EQ(s.device_bytes, 400);
  EXPECT_EQ(s.offloads, 0);
  EXPECT_EQ(s.rejected_too_large, 2);  // the check and the Put
  EXPECT_EQ(store.Locate(a), Residence::kDevice);
}

TEST(ContextStoreTest, CountsLiveContextsPerClient) {
  ContextStore store;
  const std::string a = MustPut(store, 8, "", "peer x");
  MustPut(store, 8, "", "peer x");
  MustPut(store, 8, "", "peer y");
  EXPECT_EQ(store.live_contexts_of_client("peer x"), 2);
  EXPECT_EQ(store.live_contexts_of_client("peer y"), 1);
  EXPECT_EQ(store.live_contexts_of_client("peer z"), 0);
  EXPECT_EQ(store.ModuleOf(a), "m");
  ASSERT_TRUE(store.Release(a).ok());
  EXPECT_EQ(store.live_contexts_of_client("peer x"), 1);
  EXPECT_EQ(store.ModuleOf(a), "");
}

TEST(ContextStoreTest, ABackwardAfterAServerReleaseIsToldWhy) {
  using Reason = ContextStore::ReleaseReason;
  ContextStore store;
  const std::string by_client = MustPut(store, 8), undelivered = MustPut(store, 8),
                    stream_ended = MustPut(store, 8);
  ASSERT_TRUE(store.Release(by_client).ok());
  ASSERT_TRUE(store.Release(undelivered, Reason::kUndelivered).ok());
  ASSERT_TRUE(store.Release(stream_ended, Reason::kStreamEnded).ok());
  EXPECT_EQ(store.live_contexts(), 0);
  EXPECT_EQ(store.Acquire(by_client).status().code(), absl::StatusCode::kFailedPrecondition);
  const absl::Status a = store.Acquire(undelivered).status();
  EXPECT_EQ(a.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(a, "never reached the client")) << a;
  const absl::Status b = store.Acquire(stream_ended).status();
  EXPECT_EQ(b.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(b, "Train stream that made it ended")) << b;
  // Releasing again is OK, whatever the reason was.
  EXPECT_TRUE(store.Release(undelivered).ok());
}

TEST(ContextStoreTest, ModuleOfSeesTenantsAndNeverWaitsBehindAnOffload) {
  // A context whose offload blocks in the middle of its copy until the test lets it go.
  struct StuckSaved final : SavedTensors {
    int64_t bytes() const override { return 64; }
    void ForEachTensor(const std::function<void(at::Tensor&)>& fn) override {
      {
        std::unique_lock<std::mutex> lock(mu);
        if (stick) {
          copying = true;
          cv.notify_all();
          cv.wait(lock, [&] { return !stick; });
        }
      }
      fn(data);
    }
    at::Tensor data = at::randint(0, 256, {64}, at::TensorOptions().dtype(at::kByte));
    std::mutex mu;
    std::condition_variable cv;
    bool stick = false, copying = false;
  };
  ContextStore store(ContextLimits{/*device_bytes=*/100, /*host_bytes=*/1 << 20, 0});
  auto stuck = std::make_shared<StuckSaved>();
  auto first = store.Put("m1", 1, stuck, "tenant a");
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string other_tenant = "tenant b", owner = "tenant a";
  EXPECT_EQ(store.ModuleOf(*first, &owner), "m1");
  EXPECT_EQ(store.ModuleOf(*first, &other_tenant), "");
  {
    std::lock_guard<std::mutex> lock(stuck->mu);
    stuck->stick = true;
  }
  // The second context does not fit beside the first: its Put offloads the first, holding the
  // store's lock through the copy.
  std::thread putter([&] { EXPECT_TRUE(store.Put("m2", 1, Saved(64), "tenant a").ok()); });
  bool copying = false;
  {
    std::unique_lock<std::mutex> lock(stuck->mu);
    copying = stuck->cv.wait_for(lock, std::chrono::seconds(20), [&] { return stuck->copying; });
  }
  EXPECT_TRUE(copying) << "the second Put did not offload the first context";
  auto during = std::async(std::launch::async, [&] { return store.ModuleOf(*first, &owner); });
  const bool answered = during.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  {
    std::lock_guard<std::mutex> lock(stuck->mu);
    stuck->stick = false;
  }
  stuck->cv.notify_all();
  putter.join();
  ASSERT_TRUE(answered) << "ModuleOf waited behind the offload";
  EXPECT_EQ(during.get(), "m1");
  EXPECT_EQ(store.Locate(*first), Residence::kHost);
  ASSERT_TRUE(store.Release(*first).ok());
  EXPECT_EQ(store.ModuleOf(*first, &owner), "");
}

TEST(ContextStoreTest, WhileBackwardsHoldTheDeviceAnOffloadedContextWaits) {
  ContextStore store({1000, 1 << 20, 0});
  const std::string a = MustPut(store, 600);
  const std::string b = MustPut(store, 600);  // a goes to host
  auto lb = store.Acquire(b);
  ASSERT_TRUE(lb.ok());
  // b's backward holds 600 of 1000 bytes: a cannot come back now, and stays offloaded.
  const absl::Status busy = store.Acquire(a).status();
  EXPECT_EQ(busy.code(), absl::StatusCode::kResourceExhausted) << busy;
  EXPECT_EQ(store.Locate(a), Residence::kHost);
  lb->saved.reset();
  store.Finish(b, true, false);
  auto la = store.Acquire(a);
  ASSERT_TRUE(la.ok()) << la.status();
  EXPECT_TRUE(static_cast<FakeSaved&>(*la->saved).Intact());
}

// Backwards race puts that offload and evict (memory and TTL): every backward either succeeds
// with its own bytes intact or gets NOT_FOUND saying "evicted"; the budgets are never exceeded;
// nothing crashes or frees twice (run under the sanitizer builds too).
TEST(ContextStoreTest, BackwardsRacingEvictionsEndCleanly) {
  constexpr int64_t kDevice = 8 << 10, kHost = 16 << 10;
  std::atomic<int64_t> fake_ms{0};
  const auto base = std::chrono::steady_clock::now();
  ContextStore store({kDevice, kHost, /*ttl_seconds=*/0.05},
                     [&] { return base + std::chrono::milliseconds(fake_ms.load()); });
  std::mutex ids_mu;
  std::vector<std::string> ids;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> ok{0}, evicted{0}, busy{0}, bad{0};
  std::thread producer([&] {
    std::mt19937 rng(1);
    for (int i = 0; i < 3000; ++i) {
      auto id = store.Put("m", 1, Saved(256 + rng() % 1024));
      if (!id.ok()) {
        ++bad;
        continue;
      }
      std::lock_guard<std::mutex> lock(ids_mu);
      ids.push_back(*id);
      if (i % 500 == 499) fake_ms += 100;  // now and then time jumps past the TTL
    }
    stop = true;
  });
  std::vector<std::thread> consumers;
  for (int t = 0; t < 3; ++t) {
    consumers.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      while (!stop.load()) {
        std::string id;
        {
          std::lock_guard<std::mutex> lock(ids_mu);
          // Leave a backlog of live contexts (about 40 x 770 bytes, more than both budgets), so
          // offloads and memory evictions happen however fast the backwards run.
          if (ids.size() > 40) {
            const size_t k0 = rng() % ids.size();
            id = ids[k0];
            ids[k0] = ids.back();
            ids.pop_back();
          }
        }
        if (id.empty()) {
          std::this_thread::yield();
          continue;
        }
        auto lease = store.Acquire(id);
        if (lease.ok()) {
          if (!static_cast<FakeSaved&>(*lease->saved).Intact()) ++bad;
          lease->saved.reset();
          store.Finish(id, /*consumed=*/true, /*retain=*/false);
          ++ok;
        } else if (lease.status().code() == absl::StatusCode::kNotFound &&
                   Contains(lease.status(), "evicted")) {
          ++evicted;
        } else if (lease.status().code() == absl::StatusCode::kResourceExhausted) {
          ++busy;  // the other backwards held the device at that moment; legitimate
        } else {
          ADD_FAILURE() << lease.status();
          ++bad;
        }
        const ContextStats s = store.stats();
        if (s.device_bytes > kDevice || s.host_bytes > kHost) ++bad;
      }
    });
  }
  producer.join();
  for (auto& c : consumers) c.join();
  const ContextStats s = store.stats();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(ok.load(), 0);
  EXPECT_GT(s.offloads, 0);
  EXPECT_GT(s.evicted_memory, 0);
  EXPECT_GT(s.evicted_ttl, 0);
  EXPECT_LE(s.peak_device_bytes, kDevice);
  EXPECT_LE(s.peak_host_bytes, kHost);
  std::printf(
      "race: %lld backwards ok, %lld evicted, %lld busy; %lld offloads, %lld restores, "
      "%lld evicted (memory), %lld evicted (ttl)\n",
      (long long)ok, (long long)evicted, (long long)busy, (long long)s.offloads,
      (long long)s.restores, (long long)s.evicted_memory, (long long)s.evicted_ttl);
  // Whatever is left still adds up.
  int64_t left = 0;
  for (const std::string& id : ids) left += store.Locate(id) != Residence::kNone;
  EXPECT_EQ(left, s.live);
}

}  // namespace
}  // namespace gradwire::core
