// Dynamic batching through the real service (--max-batch-rows, docs/batching.md): concurrent
// forwards of many clients run in batches and each gets exactly the bits a server without
// batching gives it (training forwards: their own contexts, whose backwards give the same
// grad_input); queued backwards of one module run as one batch with a plain server's grad_input; a
// request that passes its deadline inside a batch fails alone while the others go on; bad requests
// get their own errors.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/device/cpu_gemm.h"
#include "server/rpc/auth.h"
#include "test_server.h"

namespace gradwire::testing {
namespace {

constexpr int64_t kIn = 96, kOut = 64, kFfn = 128;

// Arms a round of concurrent clients: the first request prepared after Arm(n) holds the
// executor until n calls are live at the server (or 20 s pass), so they all queue behind it and
// the batcher finds them together however slowly their threads start on a loaded machine.
class GatherRound {
 public:
  void Arm(int64_t calls) { armed_.store(calls); }
  std::function<void()> Hook() {
    return [this] {
      const int64_t calls = armed_.exchange(0);
      if (calls == 0) return;
      WaitFor([calls] { return rpc::GradwireService::live_calls() >= calls; }, 20000);
    };
  }

 private:
  std::atomic<int64_t> armed_{0};
};

std::string CreateModule(client::Client& c, v1::ModuleKind kind, uint64_t seed) {
  v1::ModuleSpec spec;
  spec.set_kind(kind);
  spec.set_in_features(kIn);
  spec.set_out_features(kOut);
  if (kind == v1::LAYERNORM_MLP) spec.set_ffn_features(kFfn);
  spec.set_bias(true);
  spec.set_seed(seed);
  auto info = c.CreateModule(spec);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->module_id() : std::string();
}

class BatchServiceTest : public ::testing::TestWithParam<core::CpuGemm> {
 protected:
  void SetUp() override { core::SetCpuGemm(GetParam()); }
  void TearDown() override { core::SetCpuGemm(core::CpuGemm::kOrdered); }
};

TEST_P(BatchServiceTest, ConcurrentForwardsGetTheBitsOfAServerWithoutBatching) {
  GatherRound round;
  TestServer batched([&](rpc::ServiceOptions& o) {
    o.batching.max_rows = 512;
    o.batching.delay = std::chrono::microseconds(20000);
    o.before_forward_compute = round.Hook();
  });
  TestServer plain;
  ASSERT_TRUE(batched.ok() && plain.ok());
  auto b = batched.Connect();
  auto p = plain.Connect();
  for (v1::ModuleKind kind : {v1::LINEAR, v1::LAYERNORM_LINEAR, v1::LAYERNORM_MLP}) {
    SCOPED_TRACE(v1::ModuleKind_Name(kind));
    const std::string on_batched = CreateModule(*b, kind, 11);
    const std::string on_plain = CreateModule(*p, kind, 11);
    constexpr int kClients = 24;
    std::vector<client::HostTensor> inputs;
    std::mt19937 rng(std::random_device{}());
    for (int i = 0; i < kClients; ++i) {
      client::HostTensor x = Random({1 + int64_t(rng() % 9), kIn});
      const float scale = std::pow(4.0f, float(i % 5) - 2.0f);  // each its own amax
      for (float& v : x.data) v *= scale;
      inputs.push_back(std::move(x));
    }
    std::vector<absl::StatusOr<client::ForwardResult>> results(kClients,
                                                               absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    round.Arm(kClients);
    for (int i = 0; i < kClients; ++i) {
      threads.emplace_back([&, i] {
        auto c = batched.Connect();
        results[size_t(i)] = c->Forward(on_batched, inputs[size_t(i)], false);
      });
    }
    for (auto& t : threads) t.join();
    int batched_requests = 0;
    for (int i = 0; i < kClients; ++i) {
      ASSERT_TRUE(results[size_t(i)].ok()) << results[size_t(i)].status();
      auto alone = p->Forward(on_plain, inputs[size_t(i)], false);
      ASSERT_TRUE(alone.ok()) << alone.status();
      EXPECT_EQ(alone->batch_requests, 0);
      EXPECT_EQ(results[size_t(i)]->output.shape, alone->output.shape);
      EXPECT_EQ(results[size_t(i)]->output.data, alone->output.data) << "request " << i;
      if (results[size_t(i)]->batch_requests > 1) ++batched_requests;
    }
    // All were queued together: most run in batches (how many per batch is the batcher's).
    EXPECT_GT(batched_requests, kClients / 2);
  }
}

TEST_P(BatchServiceTest, ARequestPastItsDeadlineInsideABatchFailsAloneAndTheOthersGoOn) {
  std::atomic<int> prepared{0};
  std::mutex mu;
  std::condition_variable cv;
  bool server_saw_cancel = false;
  TestServer server([&](rpc::ServiceOptions& o) {
    o.batching.max_rows = 512;
    o.batching.delay = std::chrono::microseconds(50000);
    o.on_unary_cancel = [&](const char* method) {
      if (std::string(method) != "Forward") return;
      std::lock_guard<std::mutex> lock(mu);
      server_saw_cancel = true;
      cv.notify_all();
    };
    // The first request prepared holds the executor until the server has seen the short deadline
    // pass, so that request is queued behind it (or is it) however late its thread started: a
    // fixed sleep let a slow start on a loaded machine arrive after the batch and run alone.
    o.before_forward_compute = [&] {
      if (prepared.fetch_add(1) != 0) return;
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, std::chrono::seconds(20), [&] { return server_saw_cancel; });
    };
  });
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string module = CreateModule(*c, v1::LAYERNORM_LINEAR, 5);
  constexpr int kClients = 6;
  std::vector<client::HostTensor> inputs;
  for (int i = 0; i < kClients; ++i) inputs.push_back(Random({2 + i, kIn}));
  std::vector<absl::StatusOr<client::ForwardResult>> results(kClients,
                                                             absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      client::ClientOptions options;
      options.server = server.address();
      options.timeout = std::chrono::milliseconds(i == 3 ? 150 : 20000);
      client::Client client(options);
      results[size_t(i)] = client.Forward(module, inputs[size_t(i)], false);
    });
  }
  for (auto& t : threads) t.join();
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(server_saw_cancel);
  }
  EXPECT_EQ(results[3].status().code(), absl::StatusCode::kDeadlineExceeded) << results[3].status();
  for (int i = 0; i < kClients; ++i) {
    if (i == 3) continue;
    ASSERT_TRUE(results[size_t(i)].ok()) << "request " << i << ": " << results[size_t(i)].status();
    auto again = c->Forward(module, inputs[size_t(i)], false);  // alone now
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(results[size_t(i)]->output.data, again->output.data) << "request " << i;
  }
  EXPECT_TRUE(WaitFor([] { return rpc::GradwireService::live_calls() <= 1; }));
}

TEST_P(BatchServiceTest, ConcurrentTrainingForwardsKeepTheirOwnContexts) {
  // Current scaling, so no request's numbers depend on the order the batch put it in: each
  // output and each context's grad_input must be a plain server's bits.
  GatherRound round;
  TestServer batched([&](rpc::ServiceOptions& o) {
    o.batching.max_rows = 512;
    o.batching.delay = std::chrono::microseconds(20000);
    o.before_forward_compute = round.Hook();
  });
  TestServer plain;
  auto b = batched.Connect();
  auto p = plain.Connect();
  for (v1::ModuleKind kind : {v1::LINEAR, v1::LAYERNORM_MLP}) {
    SCOPED_TRACE(v1::ModuleKind_Name(kind));
    const std::string mb = CreateModule(*b, kind, 3), mp = CreateModule(*p, kind, 3);
    constexpr int kClients = 12;
    std::vector<client::HostTensor> xs, gs;
    for (int i = 0; i < kClients; ++i) {
      xs.push_back(Random({1 + i % 4, kIn}));
      gs.push_back(Random({1 + i % 4, kOut}));
    }
    std::vector<absl::StatusOr<client::ForwardResult>> fwd(kClients, absl::UnknownError(""));
    std::vector<absl::StatusOr<client::HostTensor>> bwd(kClients, absl::UnknownError(""));
    std::vector<std::thread> threads;
    round.Arm(kClients);
    for (int i = 0; i < kClients; ++i) {
      threads.emplace_back([&, i] {
        auto c = batched.Connect();
        fwd[size_t(i)] = c->Forward(mb, xs[size_t(i)], true);
        if (fwd[size_t(i)].ok())
          bwd[size_t(i)] = c->Backward(fwd[size_t(i)]->context_id, gs[size_t(i)]);
      });
    }
    for (auto& t : threads) t.join();
    int in_batches = 0;
    for (int i = 0; i < kClients; ++i) {
      ASSERT_TRUE(fwd[size_t(i)].ok()) << fwd[size_t(i)].status();
      ASSERT_TRUE(bwd[size_t(i)].ok()) << bwd[size_t(i)].status();
      if (fwd[size_t(i)]->batch_requests > 1) ++in_batches;
      auto f = p->Forward(mp, xs[size_t(i)], true);
      ASSERT_TRUE(f.ok());
      EXPECT_EQ(fwd[size_t(i)]->output.data, f->output.data) << "request " << i;
      auto g = p->Backward(f->context_id, gs[size_t(i)]);
      ASSERT_TRUE(g.ok());
      EXPECT_EQ(bwd[size_t(i)]->data, g->data) << "grad_input of request " << i;
    }
    // All forwards were queued together: most ran in batches.
    EXPECT_GT(in_batches, kClients / 2);
    EXPECT_EQ(batched.host().contexts().live_contexts(), 0);
  }
}

TEST_P(BatchServiceTest, QueuedBackwardsOfOneModuleRunAsOneBatch) {
  // A forward holds the executor until every backward waits in the one open batch of their
  // module (the former counts them), so the batch runs them all. Current scaling: each
  // grad_input is a plain server's bits in any order.
  constexpr int kClients = 8;
  std::atomic<bool> hold{false}, held{false};
  std::atomic<rpc::GradwireService*> service{nullptr};
  std::mutex mu;
  std::vector<std::pair<std::string, int64_t>> observed;  // on_batch: method, requests
  TestServer batched([&](rpc::ServiceOptions& o) {
    o.on_batch = [&](const char* method, int64_t requests, int64_t) {
      std::lock_guard<std::mutex> lock(mu);
      observed.emplace_back(method, requests);
    };
    o.batching.max_rows = 4096;
    o.before_forward_compute = [&] {
      if (!hold.exchange(false)) return;
      held = true;
      WaitFor([&] { return service.load()->batched_waiting() >= kClients; }, 20000);
    };
  });
  service = &batched.service();
  TestServer plain;
  ASSERT_TRUE(batched.ok() && plain.ok());
  auto b = batched.Connect();
  auto p = plain.Connect();
  for (v1::ModuleKind kind : {v1::LINEAR, v1::LAYERNORM_LINEAR, v1::LAYERNORM_MLP}) {
    SCOPED_TRACE(v1::ModuleKind_Name(kind));
    const std::string mb = CreateModule(*b, kind, 4), mp = CreateModule(*p, kind, 4);
    std::vector<std::string> cb, cp;
    std::vector<client::HostTensor> gs;
    for (int i = 0; i < kClients; ++i) {
      const client::HostTensor x = Random({1 + i % 3, kIn});
      auto fb = b->Forward(mb, x, true);
      auto fp = p->Forward(mp, x, true);
      ASSERT_TRUE(fb.ok() && fp.ok()) << fb.status() << fp.status();
      cb.push_back(fb->context_id);
      cp.push_back(fp->context_id);
      client::HostTensor g = Random({1 + i % 3, kOut});
      for (float& v : g.data) v *= std::pow(4.0f, float(i % 5) - 2.0f);  // each its own amax
      gs.push_back(std::move(g));
    }
    const int64_t before = batched.host().Stats().batched_backwards;
    hold = true;
    held = false;
    std::thread blocker([&] { EXPECT_TRUE(b->Forward(mb, Random({2, kIn}), false).ok()); });
    ASSERT_TRUE(WaitFor([&] { return held.load(); }));
    std::vector<absl::StatusOr<client::HostTensor>> got(kClients, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int i = 0; i < kClients; ++i) {
      threads.emplace_back([&, i] {
        auto c = batched.Connect();
        got[size_t(i)] = c->Backward(cb[size_t(i)], gs[size_t(i)]);
      });
    }
    for (auto& t : threads) t.join();
    blocker.join();
    EXPECT_EQ(batched.host().Stats().batched_backwards - before, kClients);
    {
      std::lock_guard<std::mutex> lock(mu);
      ASSERT_FALSE(observed.empty());
      EXPECT_EQ(observed.back(), (std::pair<std::string, int64_t>("Backward", kClients)));
    }
    for (int i = 0; i < kClients; ++i) {
      ASSERT_TRUE(got[size_t(i)].ok()) << got[size_t(i)].status();
      auto alone = p->Backward(cp[size_t(i)], gs[size_t(i)]);
      ASSERT_TRUE(alone.ok());
      EXPECT_EQ(got[size_t(i)]->data, alone->data) << "grad_input of request " << i;
    }
    EXPECT_EQ(batched.host().contexts().live_contexts(), 0);
  }
}

TEST_P(BatchServiceTest, TwoBusyTenantsWithYieldGetAPlainServersBits) {
  // --batch-yield true with two tenants keeping the device busy: batches give requests back to
  // each other's waiting work. Every forward and backward still gets a plain server's bits and
  // every call ends once.
  auto auth = rpc::Authenticator::FromEntries(
      {{"alice", "alice-token-0123456789abcdef"}, {"bob", "bob-token-0123456789abcdef"}});
  ASSERT_TRUE(auth.ok());
  TestServerOptions o;
  o.authenticator = &*auth;
  o.configure = [](rpc::ServiceOptions& s) {
    s.batching.max_rows = 512;
    s.batching.yield = true;
  };
  TestServer batched(o);
  TestServer plain;
  ASSERT_TRUE(batched.ok() && plain.ok());
  auto p = plain.Connect();
  const std::string on_plain = CreateModule(*p, v1::LAYERNORM_LINEAR, 8);
  std::vector<std::unique_ptr<client::Client>> owners;
  std::vector<std::string> modules;
  for (const char* token : {"alice-token-0123456789abcdef", "bob-token-0123456789abcdef"}) {
    owners.push_back(batched.Connect(token));
    modules.push_back(CreateModule(*owners.back(), v1::LAYERNORM_LINEAR, 8));
  }
  constexpr int kThreads = 6, kCalls = 15;
  struct Done {
    client::HostTensor x, g;
    absl::StatusOr<client::ForwardResult> fwd = absl::UnknownError("not run");
    absl::StatusOr<client::HostTensor> bwd = absl::UnknownError("not run");
  };
  std::vector<std::vector<Done>> done(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto c =
          batched.Connect(t % 2 ? "bob-token-0123456789abcdef" : "alice-token-0123456789abcdef");
      for (int i = 0; i < kCalls; ++i) {
        Done d;
        d.x = Random({1 + (t + i) % 3, kIn});
        d.g = Random({1 + (t + i) % 3, kOut});
        d.fwd = c->Forward(modules[size_t(t % 2)], d.x, true);
        if (d.fwd.ok()) d.bwd = c->Backward(d.fwd->context_id, d.g);
        done[size_t(t)].push_back(std::move(d));
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    for (const Done& d : done[size_t(t)]) {
      ASSERT_TRUE(d.fwd.ok()) << d.fwd.status();
      ASSERT_TRUE(d.bwd.ok()) << d.bwd.status();
      auto f = p->Forward(on_plain, d.x, true);
      ASSERT_TRUE(f.ok());
      EXPECT_EQ(d.fwd->output.data, f->output.data);
      auto g = p->Backward(f->context_id, d.g);
      ASSERT_TRUE(g.ok());
      EXPECT_EQ(d.bwd->data, g->data);
    }
  }
  EXPECT_EQ(batched.host().contexts().live_contexts(), 0);
  EXPECT_TRUE(WaitFor([] { return rpc::GradwireService::live_calls() <= 1; }));
}

TEST_P(BatchServiceTest, BadRequestsGetTheirErrorsWithBatchingOn) {
  TestServer server([](rpc::ServiceOptions& o) { o.batching.max_rows = 64; });
  auto c = server.Connect();
  const std::string module = CreateModule(*c, v1::LINEAR, 1);
  auto wrong = c->Forward(module, Random({2, kIn + 1}), false);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument) << wrong.status();
  auto unknown = c->Forward("0123456789abcdef0123456789abcdef", Random({2, kIn}), false);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  client::HostTensor inf = Random({2, kIn});
  inf.data[7] = std::numeric_limits<float>::infinity();
  auto bad = c->Forward(module, inf, false);
  EXPECT_FALSE(bad.ok());
  EXPECT_TRUE(c->Forward(module, Random({2, kIn}), false).ok());
}

INSTANTIATE_TEST_SUITE_P(Gemms, BatchServiceTest,
                         ::testing::Values(core::CpuGemm::kBlas, core::CpuGemm::kOrdered),
                         [](const ::testing::TestParamInfo<core::CpuGemm>& info) {
                           return std::string(info.param == core::CpuGemm::kBlas ? "Blas"
                                                                                 : "Ordered");
                         });

}  // namespace
}  // namespace gradwire::testing
