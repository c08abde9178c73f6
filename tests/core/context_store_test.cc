// The context store on its own: ids, byte accounting, states.
#include "server/core/context_store.h"

#include <gtest/gtest.h>

#include <set>

namespace gradwire::core {
namespace {

struct FakeSaved final : SavedTensors {
  explicit FakeSaved(int64_t b) : b_(b) {}
  int64_t bytes() const override { return b_; }
  int64_t b_;
};

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
  const std::string a = store.Put("m", 1, std::make_shared<FakeSaved>(100));
  const std::string b = store.Put("m", 1, std::make_shared<FakeSaved>(23));
  const std::string c = store.Put("n", 1, std::make_shared<FakeSaved>(7));
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

}  // namespace
}  // namespace gradwire::core
