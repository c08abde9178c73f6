// Limits over loopback: request bytes, tensor elements, live contexts per client, queued calls per
// module, and the context memory budgets (offload, eviction). Each refusal is RESOURCE_EXHAUSTED
// naming its flag and changes nothing.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "gradwire/client/client.h"
#include "server/core/tensor_calls.h"
#include "server/metrics.h"
#include "server/rpc/auth.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire {
namespace {

using client::HostTensor;
using testing::Random;
using testing::TestServer;
using testing::TestServerOptions;
using testing::WaitFor;

constexpr char kAliceToken[] = "alice-0123456789abcdef";
constexpr char kBobToken[] = "bob-fedcba9876543210xyz";

v1::ModuleSpec Linear(int64_t in, int64_t out, bool delayed = true) {
  v1::ModuleSpec spec = testing::LinearSpec(in, out, true, 11);
  if (delayed) spec.mutable_recipe()->set_scaling(v1::DELAYED);
  return spec;
}

bool Says(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

// What a refused call must leave as it was: contexts, weights, FP8 scaling state.
struct Snapshot {
  int64_t live = 0;
  uint64_t version = 0;
  std::vector<core::RoleScaling> scaling;
  core::ParametersCopy weights;
};
Snapshot Take(TestServer& server, const std::string& module) {
  Snapshot s;
  s.live = server.host().Stats().live_contexts;
  s.version = server.host().Info(module)->weight_version;
  s.scaling = *server.host().Scaling(module);
  s.weights = *core::TensorWeights(server.host(), module);
  return s;
}
void ExpectUnchanged(const Snapshot& a, const Snapshot& b) {
  EXPECT_EQ(a.live, b.live);
  EXPECT_EQ(a.version, b.version);
  ASSERT_EQ(a.scaling.size(), b.scaling.size());
  for (size_t i = 0; i < a.scaling.size(); ++i) {
    EXPECT_EQ(a.scaling[i].history, b.scaling[i].history) << a.scaling[i].role;
  }
  ASSERT_EQ(a.weights.tensors.size(), b.weights.tensors.size());
  for (size_t i = 0; i < a.weights.tensors.size(); ++i) {
    EXPECT_TRUE(a.weights.tensors[i].second.equal(b.weights.tensors[i].second));
  }
}

TEST(LimitsTest, RequestBytes) {
  TestServerOptions o;
  o.limits.max_request_bytes = 64 << 10;
  TestServer server(o);
  ASSERT_TRUE(server.ok());
  // The limit is on the wire's messages: this client keeps its tensors there (on this host it
  // would pass them through shared memory, whose tensors --max-tensor-elements bounds instead).
  client::ClientOptions wire_only;
  wire_only.shared_memory = client::ClientOptions::SharedMemory::kOff;
  auto c = server.Connect(wire_only);
  const std::string m = c->CreateModule(Linear(256, 8))->module_id();
  ASSERT_TRUE(c->Forward(m, Random({40, 256}), true).ok());  // 40 KiB
  const Snapshot before = Take(server, m);
  // 80 KiB: read, refused by the explicit check.
  auto fwd = c->Forward(m, Random({80, 256}), true);
  EXPECT_EQ(fwd.status().code(), absl::StatusCode::kResourceExhausted) << fwd.status();
  EXPECT_TRUE(Says(fwd.status(), "--max-request-bytes")) << fwd.status();
  auto set = c->SetWeights(m, {{"weight", Random({8, 256})}, {"bias", Random({8})}});
  ASSERT_TRUE(set.ok()) << set.status();  // 8 KiB is fine
  const Snapshot mid = Take(server, m);
  std::vector<std::pair<std::string, HostTensor>> big_weights = {{"weight", Random({80, 256})}};
  auto too_big = c->SetWeights(m, big_weights);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Says(too_big.status(), "--max-request-bytes")) << too_big.status();
  ExpectUnchanged(mid, Take(server, m));
  EXPECT_EQ(before.live, server.host().Stats().live_contexts);
  // A Train-stream message over the limit is refused on its own; the stream goes on.
  auto stream = c->OpenTrainStream();
  ASSERT_TRUE(stream->SendForward(1, m, Random({80, 256}), true));
  ASSERT_TRUE(stream->SendForward(2, m, Random({4, 256}), false));
  auto r1 = stream->Read();
  auto r2 = stream->Read();
  ASSERT_TRUE(r1 && r2);
  EXPECT_EQ(r1->code(), int(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_NE(r1->message().find("--max-request-bytes"), std::string::npos) << r1->message();
  EXPECT_EQ(r2->code(), 0) << r2->message();
  stream->Finish().IgnoreError();
  // Far beyond (over twice the limit) the transport drops it unread: still RESOURCE_EXHAUSTED.
  auto huge = c->Forward(m, Random({200, 256}), true);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_EQ(before.live, server.host().Stats().live_contexts);
}

TEST(LimitsTest, TensorElements) {
  TestServerOptions o;
  o.limits.max_tensor_elements = 10000;
  TestServer server(o);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string m = c->CreateModule(Linear(4, 4096))->module_id();
  ASSERT_TRUE(c->Forward(m, Random({2, 4}), true).ok());  // output 8192 elements
  const Snapshot before = Take(server, m);
  // A tiny input whose output would be 12288 elements.
  auto fwd = c->Forward(m, Random({3, 4}), true);
  EXPECT_EQ(fwd.status().code(), absl::StatusCode::kResourceExhausted) << fwd.status();
  EXPECT_TRUE(Says(fwd.status(), "--max-tensor-elements")) << fwd.status();
  EXPECT_TRUE(Says(fwd.status(), "the output")) << fwd.status();
  ExpectUnchanged(before, Take(server, m));
  // The MLP's hidden layer counts too.
  v1::ModuleSpec mlp;
  mlp.set_kind(v1::LAYERNORM_MLP);
  mlp.set_in_features(8);
  mlp.set_out_features(8);
  mlp.set_ffn_features(2048);
  mlp.set_activation(v1::SWIGLU);  // gated: FC1 is 4096 wide
  const std::string mm = c->CreateModule(mlp)->module_id();
  ASSERT_TRUE(c->Forward(mm, Random({2, 8}), true).ok());
  auto hidden = c->Forward(mm, Random({3, 8}), true);
  EXPECT_EQ(hidden.status().code(), absl::StatusCode::kResourceExhausted) << hidden.status();
  EXPECT_TRUE(Says(hidden.status(), "FC1")) << hidden.status();
  // Tensors sent: parameters of SetWeights.
  const std::string wide = c->CreateModule(Linear(128, 128))->module_id();
  auto set = c->SetWeights(wide, {{"weight", Random({128, 128})}});
  EXPECT_EQ(set.status().code(), absl::StatusCode::kResourceExhausted) << set.status();
  EXPECT_TRUE(Says(set.status(), "--max-tensor-elements")) << set.status();
  EXPECT_EQ(server.host().Info(wide)->weight_version, 1u);
}

TEST(LimitsTest, ContextsPerPeerWithoutTokens) {
  TestServerOptions o;
  o.limits.max_contexts_per_client = 3;
  TestServer server(o);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto c2 = server.Connect();  // another connection from the same address: the same client
  const std::string m = c->CreateModule(Linear(16, 8))->module_id();
  std::vector<std::string> ids;
  for (int i = 0; i < 2; ++i) ids.push_back(c->Forward(m, Random({4, 16}), true)->context_id);
  ids.push_back(c2->Forward(m, Random({4, 16}), true)->context_id);
  const Snapshot before = Take(server, m);
  auto fwd = c->Forward(m, Random({4, 16}), true);
  EXPECT_EQ(fwd.status().code(), absl::StatusCode::kResourceExhausted) << fwd.status();
  EXPECT_TRUE(Says(fwd.status(), "--max-contexts-per-client")) << fwd.status();
  EXPECT_EQ(c2->Forward(m, Random({4, 16}), true).status().code(),
            absl::StatusCode::kResourceExhausted);
  ExpectUnchanged(before, Take(server, m));
  // Inference makes no context and is not limited; a backward frees a slot.
  EXPECT_TRUE(c->Forward(m, Random({4, 16}), false).ok());
  ASSERT_TRUE(c->Backward(ids[0], Random({4, 8})).ok());
  EXPECT_TRUE(c->Forward(m, Random({4, 16}), true).ok());
}

TEST(LimitsTest, ContextsPerTenantWithTokens) {
  auto auth = rpc::Authenticator::FromEntries({{"alice", kAliceToken}, {"bob", kBobToken}});
  ASSERT_TRUE(auth.ok());
  TestServerOptions o;
  o.authenticator = &*auth;
  o.limits.max_contexts_per_client = 2;
  TestServer server(o);
  ASSERT_TRUE(server.ok());
  auto alice = server.Connect(kAliceToken), bob = server.Connect(kBobToken);
  const std::string ma = alice->CreateModule(Linear(16, 8))->module_id();
  const std::string mb = bob->CreateModule(Linear(16, 8))->module_id();
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(alice->Forward(ma, Random({4, 16}), true).ok());
  auto over = alice->Forward(ma, Random({4, 16}), true);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Says(over.status(), "tenant alice")) << over.status();
  // Bob, on the same address, has his own allowance.
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(bob->Forward(mb, Random({4, 16}), true).ok());
  EXPECT_EQ(server.host().Stats().live_contexts, 4);
}

TEST(LimitsTest, QueuedCallsPerModule) {
  TestServerOptions o;
  o.limits.max_queued_per_module = 3;
  TestServer server(o);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string m = c->CreateModule(Linear(16, 8))->module_id();
  const std::string other = c->CreateModule(Linear(16, 8))->module_id();
  // Hold the device so calls queue.
  std::mutex mu;
  std::condition_variable cv;
  bool release = false, holding = false;
  server.executor().Submit([&] {
    std::unique_lock<std::mutex> lock(mu);
    holding = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return holding; });
  }
  std::vector<std::thread> waiting;
  std::atomic<int> ok{0};
  for (int i = 0; i < 3; ++i) {
    waiting.emplace_back([&] { ok += c->Forward(m, Random({4, 16}), true).ok(); });
  }
  ASSERT_TRUE(WaitFor([&] { return server.executor().queued() == 3; }));
  const Snapshot before = Take(server, m);
  auto refused = c->Forward(m, Random({4, 16}), true);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_TRUE(Says(refused.status(), "--max-queued-per-module")) << refused.status();
  EXPECT_EQ(server.executor().queued(), 3);  // it never queued
  // Chunked calls and Train stream messages count against the same limit.
  client::ClientOptions chunked_options;
  chunked_options.server = server.address();
  chunked_options.chunking = client::ClientOptions::Chunking::kAlways;
  // F32: under the exact wire this new client would first ask for the module's spec
  // (ListModules), which queues behind the held device like any other call.
  chunked_options.wire_dtype = client::WireDType::kF32;
  auto chunked = server.Connect(chunked_options);
  auto refused_chunked = chunked->Forward(m, Random({4, 16}), true);
  EXPECT_EQ(refused_chunked.status().code(), absl::StatusCode::kResourceExhausted)
      << refused_chunked.status();
  EXPECT_TRUE(Says(refused_chunked.status(), "--max-queued-per-module"))
      << refused_chunked.status();
  auto refused_weights = chunked->GetWeights(m);
  EXPECT_EQ(refused_weights.status().code(), absl::StatusCode::kResourceExhausted)
      << refused_weights.status();
  {
    auto stream = c->OpenTrainStream();
    ASSERT_TRUE(stream->SendForward(7, m, Random({4, 16}), true));
    auto answer = stream->Read();
    ASSERT_TRUE(answer.has_value());
    EXPECT_EQ(answer->request_id(), 7u);
    EXPECT_EQ(answer->code(), int(grpc::StatusCode::RESOURCE_EXHAUSTED)) << answer->message();
    EXPECT_NE(answer->message().find("--max-queued-per-module"), std::string::npos)
        << answer->message();
    EXPECT_TRUE(stream->Finish().ok());
  }
  EXPECT_EQ(server.executor().queued(), 3);
  EXPECT_EQ(server.service().queued_calls(m), 3);  // refusals count nothing
  // Another module has its own queue.
  std::thread third([&] { ok += c->Forward(other, Random({4, 16}), true).ok(); });
  ASSERT_TRUE(WaitFor([&] { return server.executor().queued() == 4; }));
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  for (auto& t : waiting) t.join();
  third.join();
  EXPECT_EQ(ok.load(), 4);
  // The refused call ran nothing: 3 contexts of m, no extra scaling step.
  EXPECT_EQ(server.host().contexts().live_contexts(m), 3);
  EXPECT_EQ(Take(server, m).scaling[0].history.size(), before.scaling[0].history.size() + 3);
  // With the queue drained the module takes calls again.
  EXPECT_EQ(server.service().queued_calls(m), 0);
  EXPECT_TRUE(c->Forward(m, Random({4, 16}), false).ok());
  // Every kind of admitted call is counted out again when it starts: chunked forward, backward
  // (counted for its context's module), weights both ways, and Train forward, backward, release.
  auto fwd = chunked->Forward(m, Random({4, 16}), true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_TRUE(chunked->Backward(fwd->context_id, Random({4, 8})).ok());
  auto weights = chunked->GetWeights(m);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_TRUE(chunked->SetWeights(m, {{"bias", Random({8})}}).ok());
  {
    auto stream = c->OpenTrainStream();
    ASSERT_TRUE(stream->SendForward(1, m, Random({4, 16}), true));
    auto f1 = stream->Read();
    ASSERT_TRUE(f1.has_value() && f1->code() == 0) << (f1 ? f1->message() : "no answer");
    ASSERT_TRUE(stream->SendForward(2, m, Random({4, 16}), true));
    auto f2 = stream->Read();
    ASSERT_TRUE(f2.has_value() && f2->code() == 0) << (f2 ? f2->message() : "no answer");
    ASSERT_TRUE(stream->SendBackward(3, f1->forward().context_id(), Random({4, 8})));
    auto b = stream->Read();
    ASSERT_TRUE(b.has_value() && b->code() == 0) << (b ? b->message() : "no answer");
    v1::TrainRequest release;
    release.set_request_id(4);
    release.mutable_release()->set_context_id(f2->forward().context_id());
    ASSERT_TRUE(stream->Send(release));
    auto r = stream->Read();
    ASSERT_TRUE(r.has_value() && r->code() == 0) << (r ? r->message() : "no answer");
    EXPECT_TRUE(stream->Finish().ok());
  }
  EXPECT_EQ(chunked->chunked_calls(), 6);  // the two refused and these four
  EXPECT_EQ(server.service().queued_calls(m), 0);
}

TEST(LimitsTest, ContextMemoryOffloadsEvictsAndReports) {
  TestServerOptions o;
  // Linear 64 -> 8 with 16 rows saves 16 * 64 = 1024 bytes of FP8 codes per context.
  o.context_limits = {/*device_bytes=*/2048, /*host_bytes=*/2048, /*ttl_seconds=*/0};
  TestServer server(o);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string m = c->CreateModule(Linear(64, 8))->module_id();
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) {
    auto f = c->Forward(m, Random({16, 64}), true);
    ASSERT_TRUE(f.ok()) << f.status();
    ids.push_back(f->context_id);
  }
  core::ContextStats s = server.host().Stats().contexts;
  EXPECT_EQ(s.device_bytes, 2048);
  EXPECT_EQ(s.host_bytes, 2048);
  EXPECT_EQ(s.evicted_memory, 1);
  // The oldest was evicted: NOT_FOUND that says so; an offloaded one comes back and works.
  auto gone = c->Backward(ids[0], Random({16, 8}));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Says(gone.status(), "evicted")) << gone.status();
  auto back = c->Backward(ids[1], Random({16, 8}));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->shape, (std::vector<int64_t>{16, 64}));
  auto never = c->Backward(std::string(32, 'a'), Random({16, 8}));
  EXPECT_EQ(never.status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(Says(never.status(), "evicted"));
  // Too large for the whole budget: refused at forward time, nothing kept.
  const Snapshot before = Take(server, m);
  auto big = c->Forward(m, Random({64, 64}), true);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Says(big.status(), "--context-memory")) << big.status();
  ExpectUnchanged(before, Take(server, m));
  // The metrics endpoint shows it all.
  server::Metrics metrics;
  const std::string text = metrics.Render(server.host(), server.executor().queued());
  s = server.host().Stats().contexts;
  for (const std::string& line : std::vector<std::string>{
           "gradwire_context_evictions_total{reason=\"memory\"} 1",
           "gradwire_context_evictions_total{reason=\"ttl\"} 0",
           "gradwire_context_restores_total 1",
           "gradwire_context_offloads_total " + std::to_string(s.offloads),
           "gradwire_context_bytes{memory=\"device\"} " + std::to_string(s.device_bytes),
           "gradwire_context_bytes{memory=\"host\"} " + std::to_string(s.host_bytes),
           "gradwire_context_rejections_total 1",
           "gradwire_live_contexts " + std::to_string(s.live),
           "gradwire_executor_queued_tasks 0"}) {
    EXPECT_NE(text.find(line + "\n"), std::string::npos) << line << "\n" << text;
  }
  EXPECT_GE(s.offloads, 3);
}

TEST(LimitsTest, EvictedContextsOfAnotherTenantReadAsNeverExisted) {
  auto auth = rpc::Authenticator::FromEntries({{"alice", kAliceToken}, {"bob", kBobToken}});
  ASSERT_TRUE(auth.ok());
  TestServerOptions o;
  o.authenticator = &*auth;
  o.context_limits = {1024, 0, 0};  // no offload: the second context evicts the first
  TestServer server(o);
  ASSERT_TRUE(server.ok());
  auto alice = server.Connect(kAliceToken), bob = server.Connect(kBobToken);
  const std::string m = alice->CreateModule(Linear(64, 8))->module_id();
  const std::string first = alice->Forward(m, Random({16, 64}), true)->context_id;
  ASSERT_TRUE(alice->Forward(m, Random({16, 64}), true).ok());
  ASSERT_EQ(server.host().Stats().contexts.evicted_memory, 1);
  EXPECT_TRUE(Says(alice->Backward(first, Random({16, 8})).status(), "evicted"));
  const std::string unknown(32, 'b');
  const absl::Status foreign = bob->Backward(first, Random({16, 8})).status();
  const absl::Status never = bob->Backward(unknown, Random({16, 8})).status();
  EXPECT_EQ(foreign.code(), absl::StatusCode::kNotFound);
  std::string expected = testing::WithoutRequestId(never.message());
  expected.replace(expected.find(unknown), unknown.size(), first);
  EXPECT_EQ(testing::WithoutRequestId(foreign.message()), expected);
}

}  // namespace
}  // namespace gradwire
