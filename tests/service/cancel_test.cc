// Deadlines and cancellation: a forward cancelled or past its deadline leaves no context and no
// partial state, whether it was still queued or already computing.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "gradwire/client/client.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire {
namespace {

using client::HostTensor;

using testing::Random;
using testing::WaitFor;
class CancelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.ok());
    client_ = server_.Connect();
    v1::ModuleSpec spec = testing::LinearSpec(1024, 1024, false, 3);
    module_ = client_->CreateModule(spec)->module_id();
  }

  v1::ForwardRequest Request(int64_t rows) {
    v1::ForwardRequest req;
    req.set_module_id(module_);
    req.set_training(true);
    *req.mutable_input() = client::ToWire(Random({rows, 1024}), client::WireDType::kF32);
    return req;
  }

  int64_t Live() { return server_.host().Stats().live_contexts; }
  int64_t Casts() {
    const auto s = server_.host().Stats();
    return s.workspace_builds + s.workspace_hits;
  }

  // The next forward stops on the executor after its last check before the compute and waits
  // there for Release(): whatever the client does meanwhile happens "during the compute", at any
  // machine speed.
  void HoldNextForward() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = true;
  }
  bool WaitHeld() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(20), [&] { return held_; });
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
    }
    cv_.notify_all();
  }
  // The forwards the server logged as failed.
  std::vector<rpc::RpcRecord> FailedForwards() {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_forwards_;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false, held_ = false, released_ = false;
  std::vector<rpc::RpcRecord> failed_forwards_;
  testing::TestServer server_{[this](rpc::ServiceOptions& o) {
    o.before_forward_compute = [this] {
      std::unique_lock<std::mutex> lock(mu_);
      if (!hold_) return;
      hold_ = false;
      held_ = true;
      cv_.notify_all();
      cv_.wait_for(lock, std::chrono::seconds(20), [&] { return released_; });
    };
    o.on_rpc_done = [this](const rpc::RpcRecord& r) {
      if (std::string(r.method) != "Forward" || r.code == absl::StatusCode::kOk) return;
      std::lock_guard<std::mutex> lock(mu_);
      failed_forwards_.push_back(r);
    };
  }};
  std::unique_ptr<client::Client> client_;
  std::string module_;
};

TEST_F(CancelTest, ForwardPastItsDeadlineWhileQueuedIsNotRun) {
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  server_.executor().Submit([&] {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return release; });
  });
  const int64_t casts = Casts();
  v1::ForwardResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  const grpc::Status s = client_->stub().Forward(&ctx, Request(4), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server's deadline is the client's plus the request's transit time (the timeout travels
  // relative); let it pass on the server too before the executor reaches the request.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  // The queued forward is skipped: no compute, no context.
  EXPECT_TRUE(client_->Forward(module_, Random({2, 1024}), false).ok());  // after it in the queue
  EXPECT_EQ(Casts(), casts + 1) << "only the later inference forward may have run";
  EXPECT_EQ(Live(), 0);
}

TEST_F(CancelTest, ForwardPastItsDeadlineDuringComputeLeavesNoContext) {
  const int64_t casts = Casts();
  HoldNextForward();
  v1::ForwardResponse resp;
  grpc::ClientContext ctx;
  // Long enough for the call to reach its hold on a slow (sanitized, shared) machine; the hold
  // makes the deadline pass during the compute however long it is.
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  const grpc::Status s = client_->stub().Forward(&ctx, Request(4), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_TRUE(WaitHeld());
  // The server's deadline is the client's plus the request's transit time; let it pass there too.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  Release();
  // The compute ran (it had started) and its context was released when it saw the deadline.
  EXPECT_TRUE(WaitFor([&] { return Casts() == casts + 1; }));
  EXPECT_TRUE(client_->Forward(module_, Random({2, 1024}), false).ok());  // queued behind it
  EXPECT_EQ(Live(), 0);
  // It stopped at the check after the compute, not before it.
  const std::vector<rpc::RpcRecord> failed = FailedForwards();
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].code, absl::StatusCode::kCancelled);
  EXPECT_NE(failed[0].message.find("during the compute"), std::string::npos) << failed[0].message;
}

TEST_F(CancelTest, ClientCancelDuringComputeLeavesNoContext) {
  const int64_t casts = Casts();
  HoldNextForward();
  v1::ForwardResponse resp;
  grpc::ClientContext ctx;
  std::thread canceller([&] {
    if (WaitHeld()) ctx.TryCancel();
  });
  const grpc::Status s = client_->stub().Forward(&ctx, Request(4), &resp);
  canceller.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED);
  Release();
  EXPECT_TRUE(WaitFor([&] { return Casts() == casts + 1; }));
  // Whether the server sees the cancel before or after its last check, the context goes: released
  // by the check, or by the call's end when the response was never delivered.
  EXPECT_TRUE(WaitFor([&] { return Live() == 0; }));
  EXPECT_EQ(Live(), 0);
  EXPECT_TRUE(client_->Forward(module_, Random({2, 1024}), false).ok());
}

// The last window: the client gives up after the forward's final cancellation check, while the
// server is still sending the response. The hook holds the call between its work and its Finish;
// the client cancels once the call is held there and the hook lets go once the client has seen
// its cancel and the server has seen it, so the window is hit every time, at any speed.
TEST(UndeliveredForwardTest, AResponseThatNeverArrivesReleasesItsContext) {
  std::mutex mu;
  std::condition_variable cv;
  bool held = false, server_saw_cancel = false, client_gone = false;
  testing::TestServer server([&](rpc::ServiceOptions& o) {
    o.on_unary_cancel = [&](const char* method) {
      if (std::string(method) != "Forward") return;
      std::lock_guard<std::mutex> lock(mu);
      server_saw_cancel = true;
      cv.notify_all();
    };
    o.before_unary_finish = [&](const char* method, const absl::Status& status) {
      if (std::string(method) != "Forward" || !status.ok()) return;
      std::unique_lock<std::mutex> lock(mu);
      if (client_gone) return;  // only the first forward is held
      held = true;
      cv.notify_all();
      cv.wait_for(lock, std::chrono::seconds(20), [&] { return client_gone; });
    };
  });
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  v1::ModuleSpec spec = testing::LinearSpec(32, 16);
  const std::string module = c->CreateModule(spec)->module_id();
  v1::ForwardRequest req;
  req.set_module_id(module);
  req.set_training(true);
  *req.mutable_input() = client::ToWire(Random({4, 32}), client::WireDType::kF32);
  v1::ForwardResponse resp;
  grpc::ClientContext ctx;
  std::thread canceller([&] {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return held; });
    ctx.TryCancel();
  });
  const grpc::Status s = c->stub().Forward(&ctx, req, &resp);
  canceller.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  // The forward ran and made its context; the client never got the id.
  EXPECT_EQ(server.host().Stats().live_contexts, 1);
  {
    // Let go once the server has seen the cancel too, else its Finish may race the client's
    // RST_STREAM and count as delivered: the window only a client can see.
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return server_saw_cancel; }));
    client_gone = true;
  }
  cv.notify_all();
  EXPECT_TRUE(WaitFor([&] { return server.host().Stats().live_contexts == 0; }));
  // A delivered forward keeps its context.
  auto kept = c->Forward(module, Random({4, 32}), true);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(server.host().Stats().live_contexts, 1);
  EXPECT_TRUE(c->ReleaseContext(kept->context_id).ok());
}

// The window no server can see: the server finished the forward and sent its answer, and the
// client gave up before it arrived (here: its deadline passes while the answer is held between
// the work and its Finish). The client named the context (ForwardRequest.context_id), so it
// releases it itself; the test holds the forward until that release has arrived, so the server's
// own release of an undelivered answer cannot be what removed it.
TEST(UnansweredForwardTest, TheClientReleasesTheContextItsForwardNamed) {
  std::mutex mu;
  std::condition_variable cv;
  bool held = false;
  std::vector<std::pair<std::string, absl::StatusCode>> releases;
  testing::TestServer server([&](rpc::ServiceOptions& o) {
    // Batched (the default server's way): a forward's answer is finished on the control thread,
    // so the device executor stays free for the client's ReleaseContext while it is held.
    o.batching.max_rows = 256;
    o.before_unary_finish = [&](const char* method, const absl::Status& status) {
      if (std::string(method) != "Forward" || !status.ok()) return;
      std::unique_lock<std::mutex> lock(mu);
      if (held) return;  // only the first forward is held
      held = true;
      cv.notify_all();
      cv.wait_for(lock, std::chrono::seconds(20), [&] { return !releases.empty(); });
    };
    o.on_rpc_done = [&](const rpc::RpcRecord& r) {
      if (std::string(r.method) != "ReleaseContext") return;
      std::lock_guard<std::mutex> lock(mu);
      releases.emplace_back(r.context_id, r.code);
      cv.notify_all();
    };
  });
  ASSERT_TRUE(server.ok());
  auto admin = server.Connect();
  const std::string module = admin->CreateModule(testing::LinearSpec(32, 16))->module_id();
  client::ClientOptions options;
  options.server = server.address();
  options.timeout = std::chrono::milliseconds(700);
  client::Client c(options);
  ASSERT_TRUE(c.WaitForReady(std::chrono::seconds(10)).ok());

  auto lost = c.Forward(module, Random({4, 32}), /*training=*/true);
  ASSERT_FALSE(lost.ok());
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kDeadlineExceeded) << lost.status();
  EXPECT_EQ(c.unanswered_releases(), 1);
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return !releases.empty(); }));
  // The forward is still held before its Finish: only the client's call can have released it.
  EXPECT_EQ(releases[0].second, absl::StatusCode::kOk);
  EXPECT_EQ(releases[0].first.size(), 32u);
  EXPECT_EQ(server.host().Stats().live_contexts, 0);
  lock.unlock();
  EXPECT_TRUE(WaitFor([&] { return server.host().Stats().live_contexts == 0; }));
  // An answered forward releases nothing and keeps its context.
  auto kept = c.Forward(module, Random({4, 32}), true);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(c.unanswered_releases(), 1);
  EXPECT_EQ(server.host().Stats().live_contexts, 1);
}

// ForwardRequest.context_id: the context takes the id the client drew; one that is malformed,
// asked of an inference forward, or names a context that is or was live is refused before
// anything runs.
TEST(ProposedContextIdTest, IsUsedOnceAndRefusedWhenMalformedOrTaken) {
  testing::TestServer server;
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string module = c->CreateModule(testing::LinearSpec(32, 16))->module_id();
  auto forward = [&](const std::string& id, bool training) {
    v1::ForwardRequest req;
    req.set_module_id(module);
    req.set_training(training);
    req.set_context_id(id);
    *req.mutable_input() = client::ToWire(Random({2, 32}), client::WireDType::kF32);
    return c->ForwardRaw(req);
  };
  const std::string id = "0123456789abcdef0123456789abcdef";
  auto made = forward(id, true);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->context_id(), id);
  const auto casts = [&] {
    const auto s = server.host().Stats();
    return s.workspace_builds + s.workspace_hits;
  };
  const int64_t before = casts();
  // Live, then consumed: taken either way, and refused before the compute.
  EXPECT_EQ(forward(id, true).status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(c->ReleaseContext(id).ok());
  auto again = forward(id, true);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(again.status().message().find(id), std::string::npos) << again.status();
  for (const std::string& bad : {std::string("0123456789ABCDEF0123456789ABCDEF"),
                                 std::string("0123"), std::string(32, 'g')}) {
    EXPECT_EQ(forward(bad, true).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  auto inference = forward("fedcba9876543210fedcba9876543210", false);
  EXPECT_EQ(inference.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(inference.status().message().find("inference"), std::string::npos)
      << inference.status();
  EXPECT_EQ(casts(), before);
  EXPECT_EQ(server.host().Stats().live_contexts, 0);
}

}  // namespace
}  // namespace gradwire
