// Dynamic batching through the real service (--max-batch-rows, docs/batching.md): concurrent
// forwards of many clients run in batches and each gets exactly the bits a server without
// batching gives it (training forwards: their own contexts, whose backwards give the same
// grad_input); queued backwards of one module run as one batch with a plain server's grad_input; a
// Train stream's, a chunked call's and a unary call's requests share one batch, and a stream's
// requests keep their order across batches; a request that passes its deadline inside a batch
// fails alone while the others go on; bad requests get their own errors.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
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

// The recipes a batch is held to a plain server's bits under: per-tensor current scaling and
// the block-scaled ones (whose blocks never span two requests' rows).
const v1::ScalingRecipe kRecipes[] = {v1::CURRENT, v1::BLOCK, v1::MXFP8};

std::string CreateModule(client::Client& c, v1::ModuleKind kind, uint64_t seed,
                         v1::ScalingRecipe recipe = v1::CURRENT) {
  v1::ModuleSpec spec;
  spec.set_kind(kind);
  spec.mutable_recipe()->set_scaling(recipe);
  spec.set_in_features(kIn);
  spec.set_out_features(kOut);
  if (kind == v1::LAYERNORM_MLP) spec.set_ffn_features(kFfn);
  spec.set_bias(true);
  spec.set_seed(seed);
  auto info = c.CreateModule(spec);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->module_id() : std::string();
}

class BatchServiceTest : public ::testing::TestWithParam<device::CpuGemm> {
 protected:
  void SetUp() override { device::SetCpuGemm(GetParam()); }
  void TearDown() override { device::SetCpuGemm(device::CpuGemm::kOrdered); }
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
  for (v1::ScalingRecipe recipe : kRecipes)
    for (v1::ModuleKind kind : {v1::LINEAR, v1::LAYERNORM_LINEAR, v1::LAYERNORM_MLP}) {
      SCOPED_TRACE(v1::ModuleKind_Name(kind) + " " + v1::ScalingRecipe_Name(recipe));
      const std::string on_batched = CreateModule(*b, kind, 11, recipe);
      const std::string on_plain = CreateModule(*p, kind, 11, recipe);
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
  // Current or block scaling, so no request's numbers depend on the order the batch put it in:
  // each output and each context's grad_input must be a plain server's bits. Clients on the exact
  // wire (the default: a Linear's input arrives as its FP8 codes, under BLOCK and MXFP8 with
  // their row blocks and columnwise copy), on F32, and on the FP8 wire (block-scaled both ways
  // under BLOCK and MXFP8: each request's results carry their own blocks).
  GatherRound round;
  TestServer batched([&](rpc::ServiceOptions& o) {
    o.batching.max_rows = 512;
    o.batching.delay = std::chrono::microseconds(20000);
    o.before_forward_compute = round.Hook();
  });
  TestServer plain;
  auto b = batched.Connect();
  for (const client::WireForm form : {client::kExactWire, client::WireForm(client::WireDType::kF32),
                                      client::WireForm(client::WireDType::kFp8E4M3)})
    for (v1::ScalingRecipe recipe : kRecipes)
      for (v1::ModuleKind kind : {v1::LINEAR, v1::LAYERNORM_MLP}) {
        SCOPED_TRACE(v1::ModuleKind_Name(kind) + " " + v1::ScalingRecipe_Name(recipe) + " " +
                     client::WireFormName(form));
        client::ClientOptions same_form;  // the plain server's client sends alike
        same_form.wire_dtype = form;
        auto p = plain.Connect(same_form);
        const std::string mb = CreateModule(*b, kind, 3, recipe),
                          mp = CreateModule(*p, kind, 3, recipe);
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
            client::ClientOptions options;
            options.wire_dtype = form;
            auto c = batched.Connect(options);
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
  // module (the former counts them), so the batch runs them all. Current or block scaling: each
  // grad_input is a plain server's bits in any order. The backwards come from the client that made
  // the contexts (the exact wire: each grad_output as its FP8 cast, with its column sums) or from
  // fresh clients that do not know them (F32).
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
  for (bool fp8_grads : {true, false})
    for (v1::ScalingRecipe recipe : kRecipes)
      for (v1::ModuleKind kind : {v1::LINEAR, v1::LAYERNORM_LINEAR, v1::LAYERNORM_MLP}) {
        SCOPED_TRACE(v1::ModuleKind_Name(kind) + " " + v1::ScalingRecipe_Name(recipe) +
                     (fp8_grads ? " FP8 grad_output" : " F32 grad_output"));
        const std::string mb = CreateModule(*b, kind, 4, recipe),
                          mp = CreateModule(*p, kind, 4, recipe);
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
        const int64_t fp8_before = b->exact_fp8_gradients();
        hold = true;
        held = false;
        std::thread blocker([&] { EXPECT_TRUE(b->Forward(mb, Random({2, kIn}), false).ok()); });
        ASSERT_TRUE(WaitFor([&] { return held.load(); }));
        std::vector<absl::StatusOr<client::HostTensor>> got(kClients,
                                                            absl::UnknownError("not run"));
        std::vector<std::thread> threads;
        for (int i = 0; i < kClients; ++i) {
          threads.emplace_back([&, i] {
            if (fp8_grads) {
              got[size_t(i)] = b->Backward(cb[size_t(i)], gs[size_t(i)]);
            } else {
              auto c = batched.Connect();
              got[size_t(i)] = c->Backward(cb[size_t(i)], gs[size_t(i)]);
            }
          });
        }
        for (auto& t : threads) t.join();
        blocker.join();
        EXPECT_EQ(batched.host().Stats().batched_backwards - before, kClients);
        EXPECT_EQ(b->exact_fp8_gradients() - fp8_before, fp8_grads ? kClients : 0);
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

// A server whose next forward (after Hold) holds the executor until `count` requests wait in
// batches, so requests of every call shape queue behind it and meet in the batch former however
// slowly their threads start; every batch that ran together is observed.
class HeldServer {
 public:
  HeldServer()
      : server_([this](rpc::ServiceOptions& o) {
          o.batching.max_rows = 4096;
          o.on_batch = [this](const char* method, int64_t requests, int64_t) {
            std::lock_guard<std::mutex> lock(mu_);
            observed_.emplace_back(method, requests);
          };
          o.before_forward_compute = [this] {
            const int64_t count = hold_.exchange(0);
            if (count == 0) return;
            held_ = true;
            WaitFor([&] { return server_.service().batched_waiting() >= count; }, 20000);
          };
        }) {}
  TestServer& server() { return server_; }
  // Starts a forward on `module` that holds the executor until `count` requests wait; returns
  // once it holds it. Release() joins it.
  void Hold(client::Client& c, const std::string& module, int64_t count) {
    held_ = false;
    hold_ = count;
    blocker_ = std::thread([&c, module] {
      EXPECT_TRUE(c.Forward(module, Random({2, kIn}), false).ok());
    });
    ASSERT_TRUE(WaitFor([&] { return held_.load(); }));
  }
  void Release() { blocker_.join(); }
  // The last batch that ran together: method and requests.
  std::pair<std::string, int64_t> last() {
    std::lock_guard<std::mutex> lock(mu_);
    return observed_.empty() ? std::pair<std::string, int64_t>() : observed_.back();
  }

 private:
  std::atomic<int64_t> hold_{0};
  std::atomic<bool> held_{false};
  std::thread blocker_;
  std::mutex mu_;
  std::vector<std::pair<std::string, int64_t>> observed_;
  TestServer server_;  // last: stopped first, while the hooks' state lives
};

// The next `n` answers of `stream`, by request id; each must be a success.
std::map<uint64_t, v1::TrainResponse> ReadAnswers(client::TrainStream& stream, int n) {
  std::map<uint64_t, v1::TrainResponse> answers;
  for (int i = 0; i < n; ++i) {
    std::optional<v1::TrainResponse> r = stream.Read();
    if (!r.has_value()) {
      ADD_FAILURE() << "the stream ended after " << i << " of " << n << " answers";
      break;
    }
    EXPECT_EQ(r->code(), 0) << r->message();
    answers[r->request_id()] = *std::move(r);
  }
  return answers;
}

TEST_P(BatchServiceTest, TrainStreamChunkedAndUnaryCallsShareOneBatch) {
  // Every call shape hands its forwards and backwards to one pipeline: a Train stream's requests,
  // a chunked call's and a unary call's, queued together, run as one batch, and each gets a plain
  // server's bits. Current scaling: no request's numbers depend on its place in the batch.
  constexpr int kStream = 4, kAll = kStream + 2;  // + one chunked call, one unary call
  HeldServer held;
  TestServer plain;
  ASSERT_TRUE(held.server().ok() && plain.ok());
  auto b = held.server().Connect();
  auto unary = held.server().Connect();
  client::ClientOptions always_chunked;
  always_chunked.chunking = client::ClientOptions::Chunking::kAlways;
  auto chunked = held.server().Connect(always_chunked);
  auto p = plain.Connect();
  const std::string mb = CreateModule(*b, v1::LAYERNORM_LINEAR, 5);
  const std::string mp = CreateModule(*p, v1::LAYERNORM_LINEAR, 5);
  std::vector<client::HostTensor> xs, gs;
  for (int i = 0; i < kAll; ++i) {
    xs.push_back(Random({1 + i % 3, kIn}));
    gs.push_back(Random({1 + i % 3, kOut}));
  }

  // The clients learn the module's widths first (ListModules, which waits for the device),
  // outside the hold.
  ASSERT_TRUE(chunked->Forward(mb, xs[0], false).ok());
  ASSERT_EQ(chunked->chunked_calls(), 1);
  ASSERT_TRUE(unary->Forward(mb, xs[0], false).ok());

  // Forwards: the stream's, then one chunked and one unary, all behind the held forward.
  held.Hold(*b, mb, kAll);
  auto stream = b->OpenTrainStream();
  for (int i = 0; i < kStream; ++i) ASSERT_TRUE(stream->SendForward(uint64_t(i), mb, xs[i], true));
  absl::StatusOr<client::ForwardResult> fc = absl::UnknownError("not run"), fu = fc;
  std::thread tc([&] { fc = chunked->Forward(mb, xs[kStream], true); });
  std::thread tu([&] { fu = unary->Forward(mb, xs[kStream + 1], true); });
  std::vector<client::ForwardResult> got(kAll);
  for (const auto& [id, r] : ReadAnswers(*stream, kStream)) {
    auto out = client::FromWire(r.forward().output());
    ASSERT_TRUE(out.ok()) << out.status();
    got[id] = {*out, r.forward().context_id()};
  }
  tc.join();
  tu.join();
  held.Release();
  ASSERT_TRUE(fc.ok() && fu.ok()) << fc.status() << fu.status();
  got[kStream] = *fc;
  got[kStream + 1] = *fu;
  EXPECT_EQ(held.last(), (std::pair<std::string, int64_t>("Forward", kAll)));
  EXPECT_EQ(chunked->chunked_calls(), 2);
  std::vector<std::string> plain_contexts;
  for (int i = 0; i < kAll; ++i) {
    auto f = p->Forward(mp, xs[i], true);
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(got[i].output.data, f->output.data) << "forward " << i;
    plain_contexts.push_back(f->context_id);
  }

  // Backwards of those contexts, the same way.
  const int64_t before = held.server().host().Stats().batched_backwards;
  const int64_t chunked_before = chunked->chunked_calls();
  held.Hold(*b, mb, kAll);
  for (int i = 0; i < kStream; ++i) {
    ASSERT_TRUE(stream->SendBackward(uint64_t(100 + i), got[i].context_id, gs[i]));
  }
  absl::StatusOr<client::HostTensor> bc = absl::UnknownError("not run"), bu = bc;
  std::thread bct([&] { bc = chunked->Backward(got[kStream].context_id, gs[kStream]); });
  std::thread but([&] { bu = unary->Backward(got[kStream + 1].context_id, gs[kStream + 1]); });
  std::vector<client::HostTensor> dx(kAll);
  for (const auto& [id, r] : ReadAnswers(*stream, kStream)) {
    auto g = client::FromWire(r.backward().grad_input());
    ASSERT_TRUE(g.ok()) << g.status();
    dx[id - 100] = *g;
  }
  bct.join();
  but.join();
  held.Release();
  ASSERT_TRUE(bc.ok() && bu.ok()) << bc.status() << bu.status();
  dx[kStream] = *bc;
  dx[kStream + 1] = *bu;
  EXPECT_EQ(held.last(), (std::pair<std::string, int64_t>("Backward", kAll)));
  EXPECT_EQ(held.server().host().Stats().batched_backwards - before, kAll);
  EXPECT_GT(chunked->chunked_calls(), chunked_before);
  for (int i = 0; i < kAll; ++i) {
    auto g = p->Backward(plain_contexts[size_t(i)], gs[i]);
    ASSERT_TRUE(g.ok());
    EXPECT_EQ(dx[i].data, g->data) << "backward " << i;
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(held.server().host().contexts().live_contexts(), 0);
}

TEST_P(BatchServiceTest, AStreamsRequestsRunInTheirOrderAcrossBatches) {
  // A Train stream's requests run in the order they came, though they wait in batches: under
  // delayed scaling each backward casts with the scale the backwards before it left, so a later
  // request that joined an earlier one's batch, ahead of a request of another key queued between
  // them, would change the bits. Backwards X, Y (skip_grad_input: another key), Z on one stream
  // give the bits of X, Y, Z one after another on a plain server, gradients included.
  HeldServer held;
  TestServer plain;
  ASSERT_TRUE(held.server().ok() && plain.ok());
  auto b = held.server().Connect();
  auto p = plain.Connect();
  v1::ModuleSpec spec;
  spec.set_kind(v1::LINEAR);
  spec.set_in_features(kIn);
  spec.set_out_features(kOut);
  spec.set_bias(true);
  spec.set_seed(12);
  spec.mutable_recipe()->set_scaling(v1::DELAYED);
  spec.mutable_recipe()->set_amax_history_len(4);
  auto cb = b->CreateModule(spec);
  auto cp = p->CreateModule(spec);
  ASSERT_TRUE(cb.ok() && cp.ok()) << cb.status() << cp.status();
  const std::string mb = cb->module_id(), mp = cp->module_id();
  constexpr int kSteps = 3;
  std::vector<std::string> on_held, on_plain;
  std::vector<client::HostTensor> gs;
  for (int i = 0; i < kSteps; ++i) {
    const client::HostTensor x = Random({2, kIn});
    auto fb = b->Forward(mb, x, true);
    auto fp = p->Forward(mp, x, true);
    ASSERT_TRUE(fb.ok() && fp.ok());
    ASSERT_EQ(fb->output.data, fp->output.data);
    on_held.push_back(fb->context_id);
    on_plain.push_back(fp->context_id);
    client::HostTensor g = Random({2, kOut});
    for (float& v : g.data) v *= std::pow(16.0f, float(i) - 1.0f);  // each its own amax
    gs.push_back(std::move(g));
  }
  auto skip = [](int i) {
    client::BackwardOptions o;
    o.skip_grad_input = i == 1;
    return o;
  };
  held.Hold(*b, mb, kSteps);
  auto stream = b->OpenTrainStream();
  for (int i = 0; i < kSteps; ++i) {
    ASSERT_TRUE(stream->SendBackward(uint64_t(i), on_held[size_t(i)], gs[size_t(i)], skip(i)));
  }
  std::map<uint64_t, v1::TrainResponse> answers = ReadAnswers(*stream, kSteps);
  ASSERT_EQ(answers.size(), size_t(kSteps));
  held.Release();
  EXPECT_TRUE(stream->Finish().ok());
  for (int i = 0; i < kSteps; ++i) {
    auto g = p->Backward(on_plain[size_t(i)], gs[size_t(i)], skip(i));
    ASSERT_TRUE(g.ok()) << g.status();
    if (i == 1) continue;  // no grad_input
    auto streamed = client::FromWire(answers[size_t(i)].backward().grad_input());
    ASSERT_TRUE(streamed.ok());
    EXPECT_EQ(streamed->data, g->data) << "backward " << i;
  }
  auto gb = b->GetGradients(mb);
  auto gp = p->GetGradients(mp);
  ASSERT_TRUE(gb.ok() && gp.ok());
  ASSERT_EQ(gb->tensors.size(), gp->tensors.size());
  for (size_t i = 0; i < gb->tensors.size(); ++i) {
    EXPECT_EQ(gb->tensors[i].second.data, gp->tensors[i].second.data) << gb->tensors[i].first;
  }
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
                         ::testing::Values(device::CpuGemm::kBlas, device::CpuGemm::kOrdered),
                         [](const ::testing::TestParamInfo<device::CpuGemm>& info) {
                           return std::string(info.param == device::CpuGemm::kBlas ? "Blas"
                                                                                   : "Ordered");
                         });

}  // namespace
}  // namespace gradwire::testing
