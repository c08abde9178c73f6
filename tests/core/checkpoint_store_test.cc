// The checkpoint directory's epochs and claims (server/core/checkpoints/checkpoint.h), two
// "servers" in one process: each a ModuleHost with a Checkpointer on the same directory; and the
// claim book on its own (claims.h).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gradwire/storage/safetensors_file.h"
#include "server/core/checkpoints/checkpoint.h"
#include "server/core/checkpoints/checkpoint_files.h"
#include "server/core/checkpoints/claims.h"
#include "server/core/checkpoints/layout.h"
#include "server/core/contexts/context_store.h"
#include "server/core/module_host.h"
#include "server/core/tensor_calls.h"
#include "test_util.h"

namespace gradwire::core {
namespace {

namespace fs = std::filesystem;
using gradwire::testing::MakeLinearSpec;
using gradwire::testing::RandN;

std::string FreshDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/gradwire-" + name + "-" + RandomId128();
  fs::remove_all(dir);
  return dir;
}

// One optimizer step: the weights and version change.
void Step(ModuleHost& host, const std::string& id) {
  auto fwd = TensorForward(host, id, RandN({3, 8}), true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  ASSERT_TRUE(TensorBackward(host, fwd->context_id, RandN({3, 4}), false, false).ok());
  ASSERT_TRUE(host.ApplyGradients(id, 0.1f).ok());
}

bool SameWeights(const ModuleHost& a, const ModuleHost& b, const std::string& id) {
  auto wa = TensorWeights(a, id), wb = TensorWeights(b, id);
  if (!wa.ok() || !wb.ok() || wa->weight_version != wb->weight_version) return false;
  for (size_t i = 0; i < wa->tensors.size(); ++i) {
    if (!wa->tensors[i].second.equal(wb->tensors[i].second)) return false;
  }
  return true;
}

TEST(CheckpointStoreTest, ATakeOverReadsTheNewestStateAndFencesTheOldHolder) {
  const std::string dir = FreshDir("takeover");
  Checkpointer first(dir, 1), second(dir, 1);
  ASSERT_TRUE(first.Prepare(/*shared=*/true).ok());
  ASSERT_TRUE(second.Prepare(/*shared=*/true).ok());
  second.handover().SetWait(0);  // fencing, not a hand-over: the holder is not asked
  ModuleHost a, b;
  auto info = a.Create(MakeLinearSpec(8, 4));
  ASSERT_TRUE(info.ok());
  const std::string id = info->module_id;
  ASSERT_TRUE(first.claims().ClaimNew(id).ok());
  EXPECT_EQ(first.claims().EpochOf(id), 1);
  Step(a, id);
  ASSERT_TRUE(first.Save(a, id).ok());
  EXPECT_TRUE(fs::exists(first.layout().StatePathOf(id, 1)));

  // The id is taken for every server on the directory.
  EXPECT_EQ(second.claims().ClaimNew(id).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(fs::is_directory(second.layout().FolderOf(id)));
  EXPECT_FALSE(fs::exists(second.layout().FolderOf(RandomId128())));
  EXPECT_EQ(second.Take(b, RandomId128()).status().code(), absl::StatusCode::kNotFound);

  auto took = second.Take(b, id);
  ASSERT_TRUE(took.ok()) << took.status();
  EXPECT_EQ(took->epoch, 2);
  EXPECT_EQ(took->from_epoch, 1);
  EXPECT_TRUE(SameWeights(a, b, id));
  const auto lost = first.claims().Lost();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].first, id);
  EXPECT_TRUE(Checkpointer::IsMoved(lost[0].second)) << lost[0].second;
  EXPECT_TRUE(second.claims().Lost().empty());

  // The old holder trains on in memory: it cannot save, and writes nothing.
  Step(a, id);
  const absl::Status refused = first.Save(a, id);
  EXPECT_TRUE(Checkpointer::IsMoved(refused)) << refused;
  EXPECT_TRUE(Checkpointer::IsMoved(first.claims().CheckHeld(id)));
  EXPECT_EQ(*first.SaveAll(a), 0);  // skipped, not an error
  // The new holder's first save supersedes the state it read.
  Step(b, id);
  ASSERT_TRUE(second.Save(b, id).ok());
  EXPECT_FALSE(fs::exists(first.layout().StatePathOf(id, 1)));
  EXPECT_TRUE(fs::exists(second.layout().StatePathOf(id, 2)));
  EXPECT_FALSE(fs::exists(first.layout().ClaimPathOf(id, 1)));

  // A third takes over from the newest (the second's), not the first's newer in-memory state.
  ModuleHost c;
  Checkpointer third(dir, 1);
  ASSERT_TRUE(third.Prepare(true).ok());
  third.handover().SetWait(0);
  ASSERT_TRUE(third.Take(c, id).ok());
  EXPECT_TRUE(SameWeights(b, c, id));
  EXPECT_FALSE(SameWeights(a, c, id));
  EXPECT_EQ(third.claims().EpochOf(id), 3);
  EXPECT_TRUE(Checkpointer::IsMoved(second.claims().CheckHeld(id)));

  // Removed by its holder: every earlier holder stays fenced, and nothing is left to take over.
  ASSERT_TRUE(third.Remove(id).ok());
  EXPECT_FALSE(fs::exists(third.layout().FolderOf(id)));
  EXPECT_TRUE(Checkpointer::IsMoved(second.claims().CheckHeld(id)));
  EXPECT_FALSE(second.Save(b, id).ok());
  EXPECT_FALSE(fs::exists(third.layout().FolderOf(id)));
  ModuleHost d;
  EXPECT_EQ(third.Take(d, id).status().code(), absl::StatusCode::kNotFound);
  fs::remove_all(dir);
}

// The hand-over: a holder whose heartbeat is fresh is asked, and when it picks the request up the
// taker waits for its save and release; one that does not answer is fenced after the wait, and
// one that left is not asked at all.
TEST(CheckpointStoreTest, ALiveHolderHandsOverAndASilentOrGoneOneIsFenced) {
  using Clock = std::chrono::steady_clock;
  const std::string dir = FreshDir("handover");
  Checkpointer first(dir, 1), second(dir, 1), third(dir, 1), fourth(dir, 1);
  for (Checkpointer* c : {&first, &second, &third, &fourth}) ASSERT_TRUE(c->Prepare(true).ok());
  ModuleHost a, b, c, d;
  auto info = a.Create(MakeLinearSpec(8, 4));
  ASSERT_TRUE(info.ok());
  const std::string id = info->module_id;
  ASSERT_TRUE(first.claims().ClaimNew(id).ok());
  Step(a, id);
  ASSERT_TRUE(first.Save(a, id).ok());
  Step(a, id);  // two steps the checkpoint does not have
  Step(a, id);
  auto newest = TensorWeights(a, id);
  ASSERT_TRUE(newest.ok());
  ASSERT_EQ(newest->weight_version, 4u);

  // The holder's side, as the server's watcher and executor do it.
  std::atomic<bool> handed{false};
  std::thread holder([&] {
    const auto until = Clock::now() + std::chrono::seconds(20);
    while (!handed && Clock::now() < until) {
      first.heartbeat().Beat();
      for (const std::string& asked : first.handover().Requests()) {
        EXPECT_EQ(asked, id);
        EXPECT_TRUE(first.handover().Requests().empty()) << "a request is picked up once";
        EXPECT_TRUE(first.Save(a, asked).ok());
        EXPECT_TRUE(a.Delete(asked, /*moved=*/true).ok());
        first.handover().Release(asked);
        handed = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  second.handover().SetWait(10);
  first.heartbeat().Beat();  // alive, however slowly this machine ran the steps
  auto took = second.Take(b, id);
  holder.join();
  ASSERT_TRUE(handed);
  ASSERT_TRUE(took.ok()) << took.status();
  EXPECT_EQ(took->epoch, 2);
  EXPECT_EQ(took->from_epoch, 1);
  EXPECT_EQ(took->weight_version, 4u) << "the steps since the holder's last save were lost";
  auto w = TensorWeights(b, id);
  ASSERT_TRUE(w.ok());
  for (size_t i = 0; i < w->tensors.size(); ++i) {
    EXPECT_TRUE(w->tensors[i].second.equal(newest->tensors[i].second));
  }
  EXPECT_EQ(first.claims().EpochOf(id), 0);
  EXPECT_FALSE(fs::exists(first.layout().ClaimPathOf(id, 1)));
  EXPECT_TRUE(second.claims().CheckHeld(id).ok());

  // A holder alive but silent: after the wait the taker fences it, and takes the module over from
  // its last checkpoint. Its request does not stay behind.
  Step(b, id);  // not saved: lost, as with a failure
  third.handover().SetWait(0.2);
  auto fenced = third.Take(c, id);
  ASSERT_TRUE(fenced.ok()) << fenced.status();
  EXPECT_EQ(fenced->epoch, 3);
  EXPECT_EQ(fenced->weight_version, 4u);
  EXPECT_TRUE(Checkpointer::IsMoved(second.claims().CheckHeld(id)));
  EXPECT_TRUE(second.handover().Requests().empty());

  // A holder that left (a clean stop) is not asked: no wait, however long the taker would wait.
  third.handover().Leave();
  fourth.handover().SetWait(30);
  const auto start = Clock::now();
  ASSERT_TRUE(fourth.Take(d, id).ok());
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(fourth.claims().EpochOf(id), 4);
  fs::remove_all(dir);
}

// The claim book alone, two of them on one directory: a holding is picked up for a hand-over
// only under the epoch asked about, and once; ending it ends that holding only; a later claim by
// another book fences this one.
TEST(ClaimBookTest, AHoldingIsPickedUpOnceAndALaterClaimFencesIt) {
  const std::string dir = FreshDir("claims");
  fs::create_directories(dir);
  const checkpoint_files::Layout layout(dir);
  ClaimBook mine(layout, RandomId128()), theirs(layout, RandomId128());
  const std::string id = RandomId128();
  ASSERT_TRUE(mine.ClaimNew(id).ok());
  EXPECT_EQ(theirs.ClaimNew(id).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(mine.EpochOf(id), 1);
  EXPECT_FALSE(mine.TookOver(id));
  EXPECT_TRUE(mine.CheckHeld(id).ok());
  EXPECT_EQ(theirs.CheckHeld(id).code(), absl::StatusCode::kFailedPrecondition);

  EXPECT_FALSE(mine.PickUp(id, {2, 3}).has_value()) << "not held under the epochs asked about";
  EXPECT_FALSE(mine.EndPickedUp(id).has_value()) << "nothing was picked up";
  EXPECT_EQ(mine.PickUp(id, {3, 1}), std::optional<int64_t>(1));
  EXPECT_FALSE(mine.PickUp(id, {1}).has_value()) << "a holding is picked up once";
  const std::optional<ClaimBook::Holding> ended = mine.EndPickedUp(id);
  ASSERT_TRUE(ended.has_value());
  EXPECT_EQ(ended->epoch, 1);
  EXPECT_EQ(mine.EpochOf(id), 0);
  EXPECT_FALSE(mine.EndPickedUp(id).has_value());

  // Taken over again here: a new holding, which a stale EndPickedUp leaves alone.
  absl::StatusOr<std::string> token = mine.ClaimNext(id, 2, {1});
  ASSERT_TRUE(token.ok()) << token.status();
  mine.Hold(id, 2, *token);
  EXPECT_TRUE(mine.TookOver(id));
  EXPECT_FALSE(mine.EndPickedUp(id).has_value());
  EXPECT_EQ(mine.EpochOf(id), 2);
  EXPECT_TRUE(mine.CheckHeld(id).ok());
  EXPECT_FALSE(fs::exists(layout.ClaimPathOf(id, 1)));
  EXPECT_TRUE(mine.Lost().empty());

  // The other book claims the next epoch: this one is fenced, and says so in Lost.
  EXPECT_EQ(theirs.ClaimNext(id, 2, {}).status().code(), absl::StatusCode::kAborted)
      << "an epoch is claimed once";
  absl::StatusOr<std::string> later = theirs.ClaimNext(id, 3, {2});
  ASSERT_TRUE(later.ok()) << later.status();
  theirs.Hold(id, 3, *later);
  EXPECT_TRUE(IsModuleMoved(mine.CheckHeld(id))) << mine.CheckHeld(id);
  const auto lost = mine.Lost();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].first, id);
  EXPECT_TRUE(theirs.CheckHeld(id).ok());
  mine.Forget(id);
  EXPECT_EQ(mine.EpochOf(id), 0);
  EXPECT_TRUE(mine.Lost().empty());
  fs::remove_all(dir);
}

TEST(CheckpointStoreTest, AFlatCheckpointReadsAsEpochZeroAndTheFirstSaveReplacesIt) {
  const std::string dir = FreshDir("flat");
  ModuleHost a;
  auto info = a.Create(MakeLinearSpec(8, 4), "alice");
  ASSERT_TRUE(info.ok());
  const std::string id = info->module_id;
  Step(a, id);
  {
    // Written as a server before epochs wrote it: one file, DIR/<id>.gradwire.safetensors.
    Checkpointer writer(dir, 1);
    ASSERT_TRUE(writer.Prepare().ok());
    ASSERT_TRUE(writer.claims().ClaimNew(id).ok());
    ASSERT_TRUE(writer.Save(a, id).ok());
    fs::rename(writer.layout().StatePathOf(id, 1), writer.layout().LegacyPathOf(id));
    fs::remove_all(writer.layout().FolderOf(id));
  }
  Checkpointer reader(dir, 1);
  ASSERT_TRUE(reader.Prepare().ok());
  ModuleHost b;
  ASSERT_EQ(*reader.RestoreAll(b), 1);
  EXPECT_TRUE(SameWeights(a, b, id));
  EXPECT_EQ(b.Info(id)->tenant, "alice");
  EXPECT_EQ(reader.claims().EpochOf(id), 1);
  ASSERT_TRUE(reader.Save(b, id).ok());
  EXPECT_FALSE(fs::exists(reader.layout().LegacyPathOf(id)));
  EXPECT_TRUE(fs::exists(reader.layout().StatePathOf(id, 1)));
  fs::remove_all(dir);
}

TEST(CheckpointStoreTest, ADirectoryIsHeldAloneOrSharedNeverBoth) {
  const std::string dir = FreshDir("lock");
  {
    Checkpointer alone(dir, 1), other(dir, 1);
    ASSERT_TRUE(alone.Prepare(false).ok());
    const absl::Status second = other.Prepare(true);
    EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(second.message().find("--checkpoint-shared"), absl::string_view::npos) << second;
    EXPECT_EQ(other.Prepare(false).code(), absl::StatusCode::kFailedPrecondition);
  }
  Checkpointer one(dir, 1), two(dir, 1), alone(dir, 1);
  EXPECT_TRUE(one.Prepare(true).ok());
  EXPECT_TRUE(two.Prepare(true).ok());
  EXPECT_EQ(alone.Prepare(false).code(), absl::StatusCode::kFailedPrecondition);
  fs::remove_all(dir);
}

TEST(CheckpointStoreTest, AnIdThatCannotNameAFolderIsRefused) {
  const std::string dir = FreshDir("names");
  Checkpointer store(dir, 1);
  ASSERT_TRUE(store.Prepare(true).ok());
  ModuleHost host;
  for (const std::string id : {"", ".", "..", "a/b", ".hidden"}) {
    EXPECT_EQ(store.claims().ClaimNew(id).code(), absl::StatusCode::kInvalidArgument) << id;
    EXPECT_EQ(store.Take(host, id).status().code(), absl::StatusCode::kInvalidArgument) << id;
  }
  // Nothing was made for them: the directory holds only the server's own dot-files.
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().filename().string()[0], '.') << entry.path();
  }
  fs::remove_all(dir);
}

// A state file's numbers are read strictly: a number outside its field's type (a float seed of
// 3e20 for a uint64, 1e300 for a float, a fraction for a count, a number for a flag) makes the
// file DATA_LOSS, never a converted value.
TEST(CheckpointStoreTest, NumbersOutsideTheirFieldsMakeTheFileDataLoss) {
  const std::string dir = FreshDir("numbers");
  ModuleHost host;
  auto info = host.Create(MakeLinearSpec(8, 4), "alice");
  ASSERT_TRUE(info.ok());
  const std::string id = info->module_id;
  Checkpointer store(dir, 1);
  ASSERT_TRUE(store.Prepare().ok());
  ASSERT_TRUE(store.claims().ClaimNew(id).ok());
  ASSERT_TRUE(store.Save(host, id).ok());
  const std::string path = store.layout().StatePathOf(id, 1);
  std::map<std::string, std::string> metadata;
  auto tensors = storage::ReadSafetensorsFile(path, &metadata);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  ASSERT_TRUE(checkpoint_files::ReadState(path).ok());
  const nlohmann::json spec = nlohmann::json::parse(metadata.at("spec"));
  const nlohmann::json scaling = nlohmann::json::parse(metadata.at("scaling"));
  ASSERT_FALSE(scaling.empty());

  using Edit = std::function<void(nlohmann::json&, nlohmann::json&)>;
  const std::vector<std::pair<std::string, Edit>> edits = {
      {"seed 3e20", [](auto& s, auto&) { s["seed"] = 3.18447e20; }},
      {"seed -1", [](auto& s, auto&) { s["seed"] = -1; }},
      {"in_features 1.5", [](auto& s, auto&) { s["in_features"] = 1.5; }},
      {"kind 2^40", [](auto& s, auto&) { s["kind"] = int64_t(1) << 40; }},
      {"margin 1e10", [](auto& s, auto&) { s["recipe"]["margin"] = 1e10; }},
      {"eps 1e300", [](auto& s, auto&) { s["layernorm_eps"] = 1e300; }},
      {"lr \"x\"", [](auto& s, auto&) { s["optimizer"]["sgd"]["learning_rate"] = "x"; }},
      {"bias 1", [](auto& s, auto&) { s["bias"] = 1; }},
      {"scale 1e300", [](auto&, auto& r) { r[0]["scale"] = 1e300; }},
      {"history [1e300]", [](auto&, auto& r) { r[0]["history"] = {1e300}; }},
      {"history 2", [](auto&, auto& r) { r[0]["history"] = 2; }},
  };
  for (const auto& [what, edit] : edits) {
    nlohmann::json s = spec, r = scaling;
    edit(s, r);
    std::map<std::string, std::string> changed = metadata;
    changed["spec"] = s.dump();
    changed["scaling"] = r.dump();
    ASSERT_TRUE(storage::WriteSafetensorsFile(path, *tensors, changed).ok());
    EXPECT_EQ(checkpoint_files::ReadState(path).status().code(), absl::StatusCode::kDataLoss)
        << what;
  }
  // The file as saved still reads: the edits, not the rewrite, were refused.
  ASSERT_TRUE(storage::WriteSafetensorsFile(path, *tensors, metadata).ok());
  EXPECT_TRUE(checkpoint_files::ReadState(path).ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace gradwire::core
