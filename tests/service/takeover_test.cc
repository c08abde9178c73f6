// Servers sharing a checkpoint directory (--checkpoint-shared) in one process: calls that arrive
// while a module is being taken over wait for it and run in order; two servers taking one module
// over at once leave exactly one holder. Run under the sanitizers (.ci/run) for the take-over's
// hand-offs between reactors, the control thread and the device executor.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "gradwire/client/client.h"
#include "server/core/checkpoints/checkpoint.h"
#include "server/core/contexts/context_store.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire {
namespace {

using testing::Random;

constexpr int64_t kIn = 24, kOut = 16;

// `check_every_s` 0: the server notices a module it lost only at that module's next step,
// upload or save, never by its own timer (so a test knows what it still holds). `handover_wait_s`
// 0: taking a module over, the server does not ask its live holder to hand it over, and fences it.
testing::TestServerOptions Shared(const std::string& dir, double check_every_s = 1,
                                  double handover_wait_s = 5) {
  testing::TestServerOptions o;
  o.checkpoint_dir = dir;
  o.checkpoint_shared = true;
  o.checkpoint_check_every_s = check_every_s;
  o.checkpoint_handover_wait_s = handover_wait_s;
  return o;
}

class TakeOverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/gradwire-takeover-" + core::RandomId128();
    a_ = std::make_unique<testing::TestServer>(Shared(dir_, /*check_every_s=*/0));
    ASSERT_TRUE(a_->ok());
    auto c = a_->Connect();
    auto info = c->CreateModule(testing::LinearSpec(kIn, kOut, true, 5));
    ASSERT_TRUE(info.ok()) << info.status();
    id_ = info->module_id();
    for (int i = 0; i < 2; ++i) {
      auto f = c->Forward(id_, Random({4, kIn}), true);
      ASSERT_TRUE(f.ok()) << f.status();
      ASSERT_TRUE(c->Backward(f->context_id, Random({4, kOut})).ok());
      ASSERT_TRUE(c->ApplyGradients(id_).ok());  // saved (--checkpoint-every 1)
    }
    auto w = c->GetWeights(id_);
    ASSERT_TRUE(w.ok());
    weights_ = *w;
  }
  void TearDown() override {
    a_.reset();
    std::filesystem::remove_all(dir_);
  }
  void ExpectWeights(client::Client& c) {
    auto w = c.GetWeights(id_);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->weight_version, weights_.weight_version);
    ASSERT_EQ(w->tensors.size(), weights_.tensors.size());
    for (size_t i = 0; i < w->tensors.size(); ++i) {
      EXPECT_EQ(w->tensors[i].second.data, weights_.tensors[i].second.data);
    }
  }

  std::string dir_, id_;
  std::unique_ptr<testing::TestServer> a_;
  client::NamedTensors weights_;
};

TEST_F(TakeOverTest, CallsArrivingDuringATakeOverWaitForItAndRunInOrder) {
  // B does not ask A to hand over: A keeps the module in memory, fenced.
  testing::TestServer b(Shared(dir_, 1, /*handover_wait_s=*/0));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b.host().List().size(), 0u);
  // A Train stream's requests, sent before any answer: the first waits for the take-over, and
  // the second must not overtake it.
  auto streamer = b.Connect();
  auto stream = streamer->OpenTrainStream(id_);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      auto c = b.Connect();
      for (int i = 0; i < 4; ++i) {
        auto f = c->Forward(id_, Random({2, kIn}), true);
        if (!f.ok() || !c->Backward(f->context_id, Random({2, kOut})).ok()) ++failures;
      }
    });
  }
  for (uint64_t r = 1; r <= 6; ++r) {
    ASSERT_TRUE(stream->SendForward(r, id_, Random({2, kIn}), r % 2 == 1));
  }
  for (uint64_t r = 1; r <= 6; ++r) {
    auto resp = stream->Read();
    ASSERT_TRUE(resp.has_value());
    EXPECT_EQ(resp->request_id(), r);
    EXPECT_EQ(resp->code(), 0) << resp->message();
  }
  EXPECT_TRUE(stream->Finish().ok());
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  ASSERT_EQ(b.host().List().size(), 1u);
  EXPECT_EQ(b.server().checkpointer()->claims().EpochOf(id_), 2);
  auto c = b.Connect();
  ExpectWeights(*c);  // backwards accumulate; the weights are the checkpoint's
  // A lost it (and, checking claims only at steps, still has it in memory): a step there is
  // refused and changes nothing, and A lets it go.
  auto on_a = a_->Connect();
  auto refused = on_a->ApplyGradients(id_);
  EXPECT_TRUE(core::Checkpointer::IsMoved(refused.status())) << refused.status();
  EXPECT_FALSE(a_->host().Has(id_));
}

// Calls admitted on a server while it held the module and still queued there when it let the
// module go (another server took it over) are told that the module moved, as the step refusals
// say it: retryable behind a proxy, not NOT_FOUND.
TEST_F(TakeOverTest, CallsQueuedWhenTheModuleMovedAreToldItMoved) {
  // B does not ask A to hand over: it fences A, which lets go when it checks its claims (here when
  // the test says so: A checks only at steps, uploads and saves).
  testing::TestServer b(Shared(dir_, 1, /*handover_wait_s=*/0));
  ASSERT_TRUE(b.ok());
  // A's device executor held, so that A's calls wait in its queue.
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  std::atomic<bool> holding{false};
  a_->executor().Submit([&holding, gate] {
    holding = true;
    gate.wait();
  });
  ASSERT_TRUE(testing::WaitFor([&] { return holding.load(); }));
  auto on_a = a_->Connect();
  absl::Status forward, step;
  // Requests built by hand: the client's own forward may ask the module's shape first, and that
  // call would be the one queued.
  v1::ForwardRequest req;
  req.set_module_id(id_);
  *req.mutable_input() = client::ToWire(Random({2, kIn}), client::WireDType::kF32);
  std::thread forwarding([&] { forward = on_a->ForwardRaw(req).status(); });
  // Counted apart from housekeeping's tasks (client ""), which the janitor queues too.
  const auto calls_queued = [&] {
    return a_->executor().queued() - a_->executor().queued(std::string());
  };
  EXPECT_TRUE(testing::WaitFor([&] { return calls_queued() == 1; }));  // (the threads are joined)
  std::thread stepping([&] { step = on_a->ApplyGradients(id_).status(); });
  EXPECT_TRUE(testing::WaitFor([&] { return calls_queued() == 2; }));
  auto on_b = b.Connect();
  ExpectWeights(*on_b);  // B takes it over
  EXPECT_EQ(a_->service().LetGoOfMovedModules(), 1);
  EXPECT_FALSE(a_->host().Has(id_));
  open.set_value();
  forwarding.join();
  stepping.join();
  EXPECT_TRUE(core::Checkpointer::IsMoved(forward)) << forward;
  EXPECT_TRUE(core::Checkpointer::IsMoved(step)) << step;
  EXPECT_FALSE(a_->host().Has(id_));  // neither took it back
  EXPECT_EQ(b.server().checkpointer()->claims().EpochOf(id_), 2);
}

// A live holder asked to hand a module over saves what it did since its last checkpoint, drops
// the module with its contexts and releases it: the taker continues from every step, and a
// context made on the holder is told that its module moved.
TEST(HandOverTest, ALiveHolderHandsOverTheStepsItDidSinceItsLastSave) {
  const std::string dir = ::testing::TempDir() + "/gradwire-handover-" + core::RandomId128();
  testing::TestServerOptions options = Shared(dir);
  options.checkpoint_every = 1000;  // saved when created, then never by a step
  testing::TestServer a(options), b(options);
  ASSERT_TRUE(a.ok() && b.ok());
  auto on_a = a.Connect();
  auto info = on_a->CreateModule(testing::LinearSpec(kIn, kOut, true, 7));
  ASSERT_TRUE(info.ok()) << info.status();
  const std::string id = info->module_id();
  for (int i = 0; i < 3; ++i) {
    auto f = on_a->Forward(id, Random({4, kIn}), true);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(on_a->Backward(f->context_id, Random({4, kOut})).ok());
    ASSERT_TRUE(on_a->ApplyGradients(id).ok());
  }
  auto open = on_a->Forward(id, Random({4, kIn}), true);  // a context left on A
  ASSERT_TRUE(open.ok()) << open.status();
  auto before = on_a->GetWeights(id);
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->weight_version, 4u);

  auto on_b = b.Connect();
  auto after = on_b->GetWeights(id);  // B takes it over: A hands it over first
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->weight_version, 4u) << "a step A took since its last save was lost";
  ASSERT_EQ(after->tensors.size(), before->tensors.size());
  for (size_t i = 0; i < after->tensors.size(); ++i) {
    EXPECT_EQ(after->tensors[i].second.data, before->tensors[i].second.data);
  }
  EXPECT_FALSE(a.host().Has(id));
  EXPECT_EQ(a.server().checkpointer()->claims().EpochOf(id), 0);
  EXPECT_EQ(b.server().checkpointer()->claims().EpochOf(id), 2);
  EXPECT_TRUE(b.server().checkpointer()->claims().CheckHeld(id).ok());
  auto lost = on_a->Backward(open->context_id, Random({4, kOut}));
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(lost.status().message().find("moved to another server"), std::string::npos)
      << lost.status();
  // B trains on from there, and saves under its own epoch.
  auto f = on_b->Forward(id, Random({4, kIn}), true);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(on_b->Backward(f->context_id, Random({4, kOut})).ok());
  auto stepped = on_b->ApplyGradients(id);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(*stepped, 5u);
  std::filesystem::remove_all(dir);
}

TEST_F(TakeOverTest, TwoServersTakingOneModuleOverAtOnceLeaveOneHolder) {
  testing::TestServer b(Shared(dir_)), c(Shared(dir_));
  ASSERT_TRUE(b.ok() && c.ok());
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int i = 0; i < 4; ++i) clients.push_back((i % 2 ? c : b).Connect());
  std::atomic<int> ready{0};
  std::vector<absl::Status> codes(clients.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < clients.size(); ++i) {
    threads.emplace_back([&, i] {
      ++ready;
      while (ready.load() < int(clients.size())) std::this_thread::yield();
      codes[i] = clients[i]->GetWeights(id_).status();
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& status : codes) {
    // A server that claimed the same epoch a moment after the other is told to retry; a call
    // admitted on a server that then handed the module to the other is told it moved (also a
    // retry). Nothing else.
    EXPECT_TRUE(status.ok() || status.code() == absl::StatusCode::kAborted ||
                core::IsModuleMoved(status))
        << status;
  }
  const bool b_holds = b.server().checkpointer()->claims().CheckHeld(id_).ok();
  const bool c_holds = c.server().checkpointer()->claims().CheckHeld(id_).ok();
  EXPECT_NE(b_holds, c_holds) << "exactly one server holds the module";
  testing::TestServer& holder = b_holds ? b : c;
  auto on_holder = holder.Connect();
  ExpectWeights(*on_holder);
  EXPECT_TRUE(on_holder->ApplyGradients(id_).ok());
  // The other lets go of it within its janitor's second, if it took it over at all.
  testing::TestServer& other = b_holds ? c : b;
  EXPECT_TRUE(testing::WaitFor([&] { return !other.host().Has(id_); }, 5000));
}

}  // namespace
}  // namespace gradwire
