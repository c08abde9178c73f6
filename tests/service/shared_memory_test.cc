// Shared-memory tensors through the real service. Regions the server makes (CreateSharedMemory,
// on by default for clients on this host): random, private, nameless once open, refused to peers
// elsewhere, bounded, closed when idle; the client library uses them by itself with the wire's
// bits. Regions clients make (--allow-shared-memory): bytes round-trip bit for bit against the
// same call with inline bytes, bounds and sizes are checked before anything is
// read or run, regions belong to their tenant and are bounded per tenant, an object its owner
// truncates mid-call costs the call and nothing else, and regions close on unregister and at
// shutdown.
#include "gradwire/client/shared_memory.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "gradwire/client/client.h"
#include "server/rpc/auth.h"
#include "server/rpc/shared_memory.h"
#include "test_server.h"

namespace gradwire {
namespace {

using client::HostTensor;
using client::SharedMemoryBuffer;
using client::WireDType;
using testing::Random;
using testing::TestServer;
using testing::TestServerOptions;

constexpr int64_t kIn = 64, kOut = 32, kRows = 6;

TestServerOptions WithSharedMemory(int max_regions = 16, const rpc::Authenticator* auth = nullptr) {
  TestServerOptions o;
  o.authenticator = auth;
  o.configure = [max_regions](rpc::ServiceOptions& options) {
    options.shared_memory.enabled = true;
    options.shared_memory.max_regions = max_regions;
  };
  return o;
}

std::unique_ptr<SharedMemoryBuffer> NewBuffer(size_t bytes) {
  auto b = SharedMemoryBuffer::Create(SharedMemoryBuffer::UniqueKey(), bytes);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

v1::ModuleSpec Spec(v1::ModuleKind kind, uint64_t seed = 11) {
  v1::ModuleSpec spec;
  spec.set_kind(kind);
  spec.set_in_features(kIn);
  spec.set_out_features(kOut);
  if (kind == v1::LAYERNORM_MLP) spec.set_ffn_features(48);
  spec.set_seed(seed);
  return spec;
}

std::string Module(client::Client& c, v1::ModuleKind kind = v1::LINEAR, uint64_t seed = 11) {
  auto info = c.CreateModule(Spec(kind, seed));
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->module_id() : "";
}

// Descriptors of this process open on the shared-memory object `key`.
int OpenOn(const std::string& key) {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (dirent* e = d != nullptr ? readdir(d) : nullptr) {
    char target[512];
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t len = readlink(link.c_str(), target, sizeof target - 1);
    if (len > 0 && std::string(target, size_t(len)) == "/dev/shm" + key) ++n;
  }
  if (d != nullptr) closedir(d);
  return n;
}

std::string Bytes(const SharedMemoryBuffer& b, const v1::Tensor& header) {
  return std::string(b.data() + header.shared_memory().offset(),
                     header.shared_memory().byte_size());
}

TEST(SharedMemoryTest, RegisterIsOffByDefault) {
  TestServer server;
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto buffer = NewBuffer(4096);
  const absl::Status s = c->RegisterSharedMemory("r", buffer->key(), 0, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(std::string(s.message()).find("--allow-shared-memory"), std::string::npos) << s;
  const std::string id = Module(*c);
  v1::ForwardRequest req;
  req.set_module_id(id);
  auto input = client::WriteShared(*buffer, "r", 0, Random({2, kIn}), WireDType::kF32);
  ASSERT_TRUE(input.ok());
  *req.mutable_input() = *input;
  EXPECT_EQ(c->ForwardRaw(req).status().code(), absl::StatusCode::kNotFound);
  auto listed = c->ListSharedMemory();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty());
}

TEST(SharedMemoryTest, OffWithTheFlag) {
  TestServer server([](rpc::ServiceOptions& o) { o.shared_memory.create = false; });
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto made = client::SharedRegion::Create(*c, 4096);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition) << made.status();
  EXPECT_NE(std::string(made.status().message()).find("--shared-memory off"), std::string::npos);
  EXPECT_EQ(c->ListSharedMemory().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SharedMemoryTest, SameHostPeers) {
  for (const char* peer :
       {"ipv4:127.0.0.1:5000", "ipv4:127.1.2.3:1", "ipv6:[::1]:5000", "ipv6:%5B::1%5D:5000",
        "ipv6:[::ffff:127.0.0.1]:9", "unix:/tmp/s", "unix-abstract:x"}) {
    EXPECT_TRUE(rpc::SameHostPeer(peer)) << peer;
  }
  for (const char* peer :
       {"ipv4:10.0.0.7:5000", "ipv4:128.0.0.1:1", "ipv6:[::2]:5000", "ipv6:[fe80::1]:1",
        "ipv6:[::ffff:10.0.0.1]:9", "inproc", "", "ipv4:", "ipv4:1127.0.0.1:5"}) {
    EXPECT_FALSE(rpc::SameHostPeer(peer)) << peer;
  }
}

// Descriptors of this process open on a removed shared-memory object whose key starts with
// `prefix`: "/dev/shm/KEY (deleted)".
std::vector<std::string> DeletedObjects(const std::string& prefix) {
  std::vector<std::string> out;
  DIR* d = opendir("/proc/self/fd");
  while (dirent* e = d != nullptr ? readdir(d) : nullptr) {
    char target[512];
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t len = readlink(link.c_str(), target, sizeof target - 1);
    const std::string t = len > 0 ? std::string(target, size_t(len)) : "";
    if (t.rfind("/dev/shm/" + prefix, 0) == 0 && t.find(" (deleted)") != std::string::npos) {
      out.push_back(link);
    }
  }
  if (d != nullptr) closedir(d);
  return out;
}

bool Hex32(const std::string& s) {
  if (s.size() != 32) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// CreateSharedMemory: a region under a random name and key, of the server's user only, whose name
// is gone from /dev/shm as soon as the client has it open; other clients' requests cannot name it
// unless they know its random name; unregistering closes the server's descriptor.
TEST(SharedMemoryTest, CreatedRegionsAreRandomPrivateAndNameless) {
  TestServer server;  // the defaults: on for loopback callers
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto a = client::SharedRegion::Create(*c, 8192);
  auto b = client::SharedRegion::Create(*c, 4096);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(Hex32((*a)->name())) << (*a)->name();
  EXPECT_NE((*a)->name(), (*b)->name());
  EXPECT_EQ((*a)->size(), 8192u);
  EXPECT_EQ((*a)->idle_timeout_s(), rpc::SharedMemoryOptions().idle_timeout_s);
  auto listed = c->ListSharedMemory((*a)->name());
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  const std::string key = (*listed)[0].key();
  EXPECT_EQ(key.rfind("/gradwire-", 0), 0u) << key;
  EXPECT_TRUE(Hex32(key.substr(10))) << key;
  // The name is gone: nobody can open the object any more; the server still holds it.
  EXPECT_NE(access(("/dev/shm" + key).c_str(), F_OK), 0);
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  EXPECT_LT(fd, 0);
  if (fd >= 0) close(fd);
  std::vector<std::string> held = DeletedObjects(key.substr(1));
  ASSERT_EQ(held.size(), 1u);
  struct stat st {};
  ASSERT_EQ(stat(held[0].c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, geteuid());
  EXPECT_EQ(server.service().shared_memory_bytes(), 8192u + 4096u);
  // Both ends see the same bytes: the server reads what the client wrote.
  const std::string id = Module(*c);
  const HostTensor x = Random({kRows, kIn});
  v1::ForwardRequest req;
  req.set_module_id(id);
  auto input = client::WriteShared(**a, 0, x, WireDType::kF32);
  ASSERT_TRUE(input.ok()) << input.status();
  *req.mutable_input() = *input;
  *req.mutable_output_shared_memory() = client::SharedRef((*a)->name(), 4096, 4096);
  auto got = c->ForwardRaw(req);
  ASSERT_TRUE(got.ok()) << got.status();
  auto y = client::ReadShared(**a, got->output());
  ASSERT_TRUE(y.ok()) << y.status();
  auto expected = c->Forward(id, x, false);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(y->data, expected->output.data);
  // Going away unregisters it: the server's descriptor closes and its bytes are given back.
  a->reset();
  EXPECT_TRUE(DeletedObjects(key.substr(1)).empty());
  EXPECT_EQ(server.service().shared_memory_bytes(), 4096u);
  EXPECT_EQ(server.service().shared_memory_regions(), 1);
}

TEST(SharedMemoryTest, CreateChecksSizesAndLimits) {
  TestServer server([](rpc::ServiceOptions& o) {
    o.shared_memory.max_bytes = 1 << 20;
    o.shared_memory.max_regions = 3;
  });
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  EXPECT_EQ(client::SharedRegion::Create(*c, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto big = client::SharedRegion::Create(*c, (1 << 20) + 1);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(big.status().message()).find("--max-shared-memory-bytes"),
            std::string::npos);
  auto a = client::SharedRegion::Create(*c, 600 << 10);
  ASSERT_TRUE(a.ok()) << a.status();
  auto over = client::SharedRegion::Create(*c, 600 << 10);  // the budget is for all regions
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  auto b = client::SharedRegion::Create(*c, 4096);
  auto d = client::SharedRegion::Create(*c, 4096);
  ASSERT_TRUE(b.ok() && d.ok());
  auto fourth = client::SharedRegion::Create(*c, 4096);
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kResourceExhausted) << fourth.status();
  EXPECT_NE(std::string(fourth.status().message()).find("--max-shared-memory-regions"),
            std::string::npos);
  EXPECT_EQ(server.service().shared_memory_regions(), 3);  // refusals changed nothing
}

// An in-process channel is not a loopback peer: the server refuses, and the client's Forward
// goes over the wire without an error, and stops asking.
TEST(SharedMemoryTest, NotOnThisHostIsRefusedAndTheClientUsesTheWire) {
  TestServer server(testing::Transport::kInProcess);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto made = client::SharedRegion::Create(*c, 4096);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(made.status().message()).find("on this host"), std::string::npos);
  const std::string id = Module(*c);
  auto y = c->Forward(id, Random({1024, kIn}), false);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_TRUE(c->shared_memory_off());
  EXPECT_EQ(c->shared_memory_calls(), 0);
  EXPECT_EQ(server.service().shared_memory_regions(), 0);
}

// Client::Forward and Backward pass large tensors through a region of their own by themselves,
// with the bits the wire gives, and keep small ones on the wire.
TEST(SharedMemoryTest, ClientUsesSharedMemoryByItselfBitForBit) {
  TestServer server;
  ASSERT_TRUE(server.ok());
  auto shm = server.Connect();
  client::ClientOptions off_options;
  off_options.shared_memory = client::ClientOptions::SharedMemory::kOff;
  auto wire = server.Connect(off_options);
  for (v1::ModuleKind kind : {v1::LINEAR, v1::LAYERNORM_LINEAR, v1::LAYERNORM_MLP}) {
    SCOPED_TRACE(v1::ModuleKind_Name(kind));
    v1::ModuleSpec spec = Spec(kind);
    spec.set_return_layernorm_output(kind == v1::LAYERNORM_LINEAR);
    auto info = shm->CreateModule(spec);
    ASSERT_TRUE(info.ok()) << info.status();
    // 512 rows: on the CUDA backend a LayerNorm's gamma/beta gradients are float atomics, one
    // per 512-row chunk into zeroed buffers, so their bits repeat only up to 1024 rows.
    const HostTensor x = Random({512, kIn}), dy = Random({512, kOut});
    const int64_t calls = shm->shared_memory_calls();
    auto y1 = wire->Forward(info->module_id(), x, true);
    auto y2 = shm->Forward(info->module_id(), x, true);
    ASSERT_TRUE(y1.ok() && y2.ok()) << y1.status() << y2.status();
    EXPECT_EQ(y1->output.data, y2->output.data);
    EXPECT_EQ(y1->output.shape, y2->output.shape);
    EXPECT_EQ(y1->layernorm_output.has_value(), y2->layernorm_output.has_value());
    if (y1->layernorm_output) EXPECT_EQ(y1->layernorm_output->data, y2->layernorm_output->data);
    client::BackwardOptions bo;
    if (y1->layernorm_output) bo.grad_layernorm_output = Random({512, kIn});
    auto g1 = wire->Backward(y1->context_id, dy, bo);
    ASSERT_TRUE(g1.ok()) << g1.status();
    auto w1 = shm->GetGradients(info->module_id(), /*zero=*/true);
    auto g2 = shm->Backward(y2->context_id, dy, bo);
    ASSERT_TRUE(g2.ok()) << g2.status();
    auto w2 = shm->GetGradients(info->module_id(), /*zero=*/true);
    ASSERT_TRUE(w1.ok() && w2.ok());
    EXPECT_EQ(g1->data, g2->data);
    EXPECT_EQ(g1->shape, g2->shape);
    ASSERT_EQ(w1->tensors.size(), w2->tensors.size());
    for (size_t i = 0; i < w1->tensors.size(); ++i) {
      EXPECT_EQ(w1->tensors[i].second.data, w2->tensors[i].second.data) << w1->tensors[i].first;
    }
    EXPECT_EQ(shm->shared_memory_calls(), calls + 2);
    // One row is a few hundred bytes: the wire.
    auto small = shm->Forward(info->module_id(), Random({1, kIn}), false);
    ASSERT_TRUE(small.ok());
    EXPECT_EQ(shm->shared_memory_calls(), calls + 2);
  }
  EXPECT_EQ(wire->shared_memory_calls(), 0);
  EXPECT_FALSE(shm->shared_memory_off());
  EXPECT_EQ(server.service().shared_memory_regions(), 1);  // one region, reused by every call
  shm.reset();
  EXPECT_EQ(server.service().shared_memory_regions(), 0);  // and unregistered with the client
}

// Regions unused for --shared-memory-idle close, and a client that holds one makes a new one.
TEST(SharedMemoryTest, IdleRegionsClose) {
  TestServer server([](rpc::ServiceOptions& o) { o.shared_memory.idle_timeout_s = 0.05; });
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string id = Module(*c);
  const HostTensor x = Random({512, kIn});
  auto first = c->Forward(id, x, false);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(c->shared_memory_calls(), 1);
  auto listed = c->ListSharedMemory();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  const std::string key = (*listed)[0].key();
  EXPECT_EQ(server.service().CloseIdleSharedMemory(), 0);  // just used
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(server.service().CloseIdleSharedMemory(), 1);
  EXPECT_EQ(server.service().shared_memory_regions(), 0);
  EXPECT_EQ(server.service().shared_memory_bytes(), 0u);
  EXPECT_TRUE(DeletedObjects(key.substr(1)).empty());  // the server's descriptor is closed
  auto again = c->Forward(id, x, false);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->output.data, first->output.data);
  EXPECT_EQ(c->shared_memory_calls(), 2);
  EXPECT_EQ(server.service().shared_memory_regions(), 1);
}

// A region the server no longer has while the client still holds it costs nothing: that call
// goes over the wire (the server refused it before anything ran), the next makes a new region.
TEST(SharedMemoryTest, ARegionGoneUnderTheClientCostsNothing) {
  TestServer server;
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string id = Module(*c);
  const HostTensor x = Random({512, kIn}), dy = Random({512, kOut});
  auto first = c->Forward(id, x, true);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(c->shared_memory_calls(), 1);
  auto listed = c->ListSharedMemory();
  ASSERT_TRUE(listed.ok() && listed->size() == 1u);
  ASSERT_EQ(*c->UnregisterSharedMemory((*listed)[0].name()), 1);  // behind the pool's back
  auto g = c->Backward(first->context_id, dy);                    // over the wire, accumulated once
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(c->shared_memory_calls(), 1);
  auto once = c->GetGradients(id, /*zero=*/true);
  auto second = c->Forward(id, x, true);  // a new region
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->output.data, first->output.data);
  EXPECT_EQ(c->shared_memory_calls(), 2);
  auto g2 = c->Backward(second->context_id, dy);
  ASSERT_TRUE(g2.ok()) << g2.status();
  EXPECT_EQ(g2->data, g->data);
  auto twice = c->GetGradients(id, /*zero=*/true);
  ASSERT_TRUE(once.ok() && twice.ok());
  for (size_t i = 0; i < once->tensors.size(); ++i) {
    EXPECT_EQ(once->tensors[i].second.data, twice->tensors[i].second.data);
  }
  EXPECT_EQ(server.host().Stats().live_contexts, 0);
}

// Inference forwards of every kind and wire dtype: input and outputs through shared memory give
// the bytes the same call with inline tensors gives.
TEST(SharedMemoryTest, ForwardBitForBitEveryDtypeAndKind) {
  TestServer server(WithSharedMemory());
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto buffer = NewBuffer(1 << 20);
  ASSERT_TRUE(c->RegisterSharedMemory("io", buffer->key(), 0, buffer->size()).ok());
  for (v1::ModuleKind kind : {v1::LINEAR, v1::LAYERNORM_LINEAR, v1::LAYERNORM_MLP}) {
    v1::ModuleSpec spec = Spec(kind);
    spec.set_return_layernorm_output(kind == v1::LAYERNORM_LINEAR);
    auto info = c->CreateModule(spec);
    ASSERT_TRUE(info.ok()) << info.status();
    for (WireDType dtype : {WireDType::kF32, WireDType::kBF16, WireDType::kF16, WireDType::kFp8E4M3,
                            WireDType::kFp8E5M2}) {
      SCOPED_TRACE(std::string(v1::ModuleKind_Name(kind)) + " " +
                   v1::DType_Name(wire::ToProto(dtype)));
      const HostTensor x = Random({2, kRows / 2, kIn});
      v1::ForwardRequest inline_req;
      inline_req.set_module_id(info->module_id());
      *inline_req.mutable_input() = client::ToWire(x, dtype);
      inline_req.set_output_dtype(wire::ToProto(dtype));
      auto expected = c->ForwardRaw(inline_req);
      ASSERT_TRUE(expected.ok()) << expected.status();

      v1::ForwardRequest req = inline_req;
      auto input = client::WriteShared(*buffer, "io", 128, x, dtype);
      ASSERT_TRUE(input.ok()) << input.status();
      EXPECT_EQ(Bytes(*buffer, *input), inline_req.input().data());  // the same encoding
      *req.mutable_input() = *input;
      *req.mutable_output_shared_memory() = client::SharedRef("io", 300000, 100000);
      if (spec.return_layernorm_output()) {
        *req.mutable_layernorm_output_shared_memory() = client::SharedRef("io", 600000, 100000);
      }
      std::memset(buffer->data() + 300000, 0xa5, 400000);
      auto got = c->ForwardRaw(req);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(got->output().has_shared_memory());
      EXPECT_TRUE(got->output().data().empty());
      EXPECT_EQ(got->output().shared_memory().offset(), 300000u);
      EXPECT_EQ(got->output().shared_memory().byte_size(), expected->output().data().size());
      EXPECT_EQ(Bytes(*buffer, got->output()), expected->output().data());
      EXPECT_EQ(got->output().scale_inv(), expected->output().scale_inv());
      EXPECT_EQ(std::vector<int64_t>(got->output().shape().begin(), got->output().shape().end()),
                (std::vector<int64_t>{2, kRows / 2, kOut}));
      // The client helper decodes what the server wrote.
      auto decoded = client::ReadShared(*buffer, got->output());
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      auto inline_decoded = client::FromWire(expected->output());
      ASSERT_TRUE(inline_decoded.ok());
      EXPECT_EQ(decoded->data, inline_decoded->data);
      if (spec.return_layernorm_output()) {
        ASSERT_TRUE(got->layernorm_output().has_shared_memory());
        EXPECT_EQ(Bytes(*buffer, got->layernorm_output()), expected->layernorm_output().data());
      }
      // Input in shared memory, output inline: the same bytes again.
      req.clear_output_shared_memory();
      req.clear_layernorm_output_shared_memory();
      auto mixed = c->ForwardRaw(req);
      ASSERT_TRUE(mixed.ok()) << mixed.status();
      EXPECT_EQ(mixed->output().data(), expected->output().data());
    }
  }
}

// A training step with every tensor in shared memory computes what the inline step computes:
// grad_input bytes and the accumulated weight gradients.
TEST(SharedMemoryTest, TrainingStepMatchesInline) {
  TestServer server(WithSharedMemory());
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto buffer = NewBuffer(1 << 20);
  ASSERT_TRUE(c->RegisterSharedMemory("io", buffer->key(), 0, buffer->size()).ok());
  for (WireDType dtype : {WireDType::kF32, WireDType::kBF16, WireDType::kFp8E4M3}) {
    SCOPED_TRACE(v1::DType_Name(wire::ToProto(dtype)));
    const std::string a = Module(*c, v1::LAYERNORM_MLP, 5), b = Module(*c, v1::LAYERNORM_MLP, 5);
    const HostTensor x = Random({kRows, kIn}), g = Random({kRows, kOut});
    v1::ForwardRequest fa;
    fa.set_module_id(a);
    fa.set_training(true);
    *fa.mutable_input() = client::ToWire(x, dtype);
    auto out_a = c->ForwardRaw(fa);
    ASSERT_TRUE(out_a.ok()) << out_a.status();
    v1::BackwardRequest ba;
    ba.set_context_id(out_a->context_id());
    *ba.mutable_grad_output() = client::ToWire(g, dtype);
    ba.set_grad_input_dtype(wire::ToProto(dtype));
    auto grad_a = c->BackwardRaw(ba);
    ASSERT_TRUE(grad_a.ok()) << grad_a.status();

    v1::ForwardRequest fb = fa;
    fb.set_module_id(b);
    *fb.mutable_input() = *client::WriteShared(*buffer, "io", 0, x, dtype);
    *fb.mutable_output_shared_memory() = client::SharedRef("io", 100000, 100000);
    auto out_b = c->ForwardRaw(fb);
    ASSERT_TRUE(out_b.ok()) << out_b.status();
    EXPECT_EQ(Bytes(*buffer, out_b->output()), out_a->output().data());
    v1::BackwardRequest bb = ba;
    bb.set_context_id(out_b->context_id());
    *bb.mutable_grad_output() = *client::WriteShared(*buffer, "io", 200000, g, dtype);
    *bb.mutable_grad_input_shared_memory() = client::SharedRef("io", 300000, 100000);
    auto grad_b = c->BackwardRaw(bb);
    ASSERT_TRUE(grad_b.ok()) << grad_b.status();
    ASSERT_TRUE(grad_b->grad_input().has_shared_memory());
    EXPECT_EQ(Bytes(*buffer, grad_b->grad_input()), grad_a->grad_input().data());
    auto wa = c->GetGradients(a), wb = c->GetGradients(b);
    ASSERT_TRUE(wa.ok() && wb.ok());
    ASSERT_EQ(wa->tensors.size(), wb->tensors.size());
    for (size_t i = 0; i < wa->tensors.size(); ++i) {
      EXPECT_EQ(wa->tensors[i].second.data, wb->tensors[i].second.data) << wa->tensors[i].first;
    }
    EXPECT_EQ(server.host().Stats().live_contexts, 0);
  }
}

TEST(SharedMemoryTest, TrainStreamTakesSharedMemoryTensors) {
  TestServer server(WithSharedMemory());
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto buffer = NewBuffer(1 << 16);
  ASSERT_TRUE(c->RegisterSharedMemory("io", buffer->key(), 0, buffer->size()).ok());
  const std::string id = Module(*c);
  const HostTensor x = Random({kRows, kIn});
  auto stream = c->OpenTrainStream();
  v1::TrainRequest fwd;
  fwd.set_request_id(1);
  fwd.mutable_forward()->set_module_id(id);
  fwd.mutable_forward()->set_training(true);
  *fwd.mutable_forward()->mutable_input() =
      *client::WriteShared(*buffer, "io", 0, x, WireDType::kF32);
  *fwd.mutable_forward()->mutable_output_shared_memory() = client::SharedRef("io", 8192, 8192);
  ASSERT_TRUE(stream->Send(fwd));
  auto r = stream->Read();
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->code(), 0) << r->message();
  ASSERT_TRUE(r->forward().output().has_shared_memory());
  auto out = client::ReadShared(*buffer, r->forward().output());
  ASSERT_TRUE(out.ok()) << out.status();
  auto direct = c->Forward(id, x, false);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(out->data, direct->output.data);
  EXPECT_TRUE(stream->Finish().ok());
}

// Every bad reference is refused before anything is read or run, with nothing left behind.
TEST(SharedMemoryTest, BadReferencesAreRefusedBeforeAnythingRuns) {
  TestServer server(WithSharedMemory());
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto buffer = NewBuffer(8192);
  ASSERT_TRUE(c->RegisterSharedMemory("small", buffer->key(), 1024, 4096).ok());
  const std::string id = Module(*c);
  const HostTensor x = Random({4, kIn});  // 1024 bytes of f32
  auto good = client::WriteShared(*buffer, "small", 0, x, WireDType::kF32);
  ASSERT_TRUE(good.ok());
  struct Case {
    const char* what;
    std::function<void(v1::ForwardRequest&)> edit;
    absl::StatusCode code;
  };
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  const std::vector<Case> cases = {
      {"offset past the region",
       [](auto& r) { r.mutable_input()->mutable_shared_memory()->set_offset(4000); },
       absl::StatusCode::kInvalidArgument},
      {"offset overflowing",
       [max](auto& r) { r.mutable_input()->mutable_shared_memory()->set_offset(max - 10); },
       absl::StatusCode::kInvalidArgument},
      {"byte_size not what the shape needs",
       [](auto& r) { r.mutable_input()->mutable_shared_memory()->set_byte_size(1020); },
       absl::StatusCode::kInvalidArgument},
      {"a shape over the element limit",
       [](auto& r) {
         r.mutable_input()->set_shape(0, int64_t(1) << 40);
         r.mutable_input()->mutable_shared_memory()->set_byte_size(uint64_t(1) << 48);
       },
       absl::StatusCode::kInvalidArgument},
      {"data and shared_memory both", [](auto& r) { r.mutable_input()->set_data("x"); },
       absl::StatusCode::kInvalidArgument},
      {"an unknown region",
       [](auto& r) { r.mutable_input()->mutable_shared_memory()->set_region("nope"); },
       absl::StatusCode::kNotFound},
      {"a malformed region name",
       [](auto& r) { r.mutable_input()->mutable_shared_memory()->set_region("../x"); },
       absl::StatusCode::kInvalidArgument},
      {"no room for the output",
       [](auto& r) { *r.mutable_output_shared_memory() = client::SharedRef("small", 2048, 100); },
       absl::StatusCode::kInvalidArgument},
      {"an output range outside the region",
       [](auto& r) { *r.mutable_output_shared_memory() = client::SharedRef("small", 4000, 512); },
       absl::StatusCode::kInvalidArgument},
      {"an output in an unknown region",
       [](auto& r) { *r.mutable_output_shared_memory() = client::SharedRef("other", 0, 512); },
       absl::StatusCode::kNotFound},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    v1::ForwardRequest req;
    req.set_module_id(id);
    req.set_training(true);
    *req.mutable_input() = *good;
    k.edit(req);
    auto r = c->ForwardRaw(req);
    EXPECT_EQ(r.status().code(), k.code) << r.status();
    EXPECT_EQ(server.host().Stats().live_contexts, 0);
  }
  // The good one works, and its backward's checks come before the backward runs.
  v1::ForwardRequest req;
  req.set_module_id(id);
  req.set_training(true);
  *req.mutable_input() = *good;
  auto fwd = c->ForwardRaw(req);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  v1::BackwardRequest back;
  back.set_context_id(fwd->context_id());
  *back.mutable_grad_output() =
      *client::WriteShared(*buffer, "small", 2048, Random({4, kOut}), WireDType::kF32);
  *back.mutable_grad_input_shared_memory() = client::SharedRef("small", 0, 1000);  // needs 1024
  EXPECT_EQ(c->BackwardRaw(back).status().code(), absl::StatusCode::kInvalidArgument);
  auto grads = c->GetGradients(id);
  ASSERT_TRUE(grads.ok());
  EXPECT_EQ(grads->accumulated_backwards, 0);  // nothing ran
  *back.mutable_grad_input_shared_memory() = client::SharedRef("small", 0, 1024);
  EXPECT_TRUE(c->BackwardRaw(back).ok());
  // The chunked calls do not take shared-memory tensors.
  client::ClientOptions chunked;
  chunked.chunking = client::ClientOptions::Chunking::kAlways;
  auto cc = server.Connect(chunked);
  grpc::ClientContext ctx;
  cc->PrepareContext(&ctx);
  auto call = cc->stub().ForwardChunked(&ctx);
  v1::ForwardRequestPart part;
  *part.mutable_header()->mutable_input() = *good;
  part.mutable_header()->set_module_id(id);
  ASSERT_TRUE(call->Write(part));
  call->WritesDone();
  v1::ForwardResponsePart ignored;
  while (call->Read(&ignored)) {
  }
  const grpc::Status status = call->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("chunked"), std::string::npos) << status.error_message();
}

TEST(SharedMemoryTest, RegistrationChecks) {
  TestServer server(WithSharedMemory(/*max_regions=*/3));
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto buffer = NewBuffer(4096);
  auto code = [&](const std::string& name, const std::string& key, uint64_t offset, uint64_t size) {
    return c->RegisterSharedMemory(name, key, offset, size).code();
  };
  EXPECT_EQ(code("a", buffer->key(), 0, 8192), absl::StatusCode::kInvalidArgument);  // too small
  EXPECT_EQ(code("a", buffer->key(), 4000, 100), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("a", buffer->key(), 0, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("a", buffer->key(), std::numeric_limits<uint64_t>::max(), 2),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("a", "/other-prefix-x", 0, 1), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("a", "/gradwire/../../etc/passwd", 0, 1), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("a", "/gradwire-does-not-exist-1234", 0, 1), absl::StatusCode::kNotFound);
  EXPECT_EQ(code("", buffer->key(), 0, 1), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("bad name", buffer->key(), 0, 1), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.service().shared_memory_regions(), 0);
  EXPECT_EQ(code("a", buffer->key(), 0, 4096), absl::StatusCode::kOk);
  EXPECT_EQ(code("a", buffer->key(), 0, 16), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(code("b", buffer->key(), 16, 16), absl::StatusCode::kOk);
  EXPECT_EQ(code("c", buffer->key().substr(1), 0, 16), absl::StatusCode::kOk);  // no '/'
  const absl::Status over = c->RegisterSharedMemory("d", buffer->key(), 0, 16);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_NE(std::string(over.message()).find("--max-shared-memory-regions"), std::string::npos);
  auto list = c->ListSharedMemory();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 3u);
  EXPECT_EQ((*list)[1].name(), "b");
  EXPECT_EQ((*list)[1].offset(), 16u);
  EXPECT_EQ((*list)[1].key(), buffer->key());
  EXPECT_EQ(c->ListSharedMemory("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*c->UnregisterSharedMemory("a"), 1);
  EXPECT_EQ(c->UnregisterSharedMemory("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*c->UnregisterSharedMemory(), 2);
  EXPECT_EQ(server.service().shared_memory_regions(), 0);
}

TEST(SharedMemoryTest, RegionsBelongToTheirTenant) {
  auto auth = rpc::Authenticator::FromEntries(
      {{"alice", "alice-0123456789abcdef"}, {"bob", "bob-fedcba9876543210xyz"}});
  ASSERT_TRUE(auth.ok());
  TestServer server(WithSharedMemory(/*max_regions=*/2, &*auth));
  ASSERT_TRUE(server.ok());
  auto alice = server.Connect("alice-0123456789abcdef");
  auto bob = server.Connect("bob-fedcba9876543210xyz");
  auto a_buf = NewBuffer(1 << 16), b_buf = NewBuffer(1 << 16);
  ASSERT_TRUE(alice->RegisterSharedMemory("io", a_buf->key(), 0, a_buf->size()).ok());
  // Bob can neither register Alice's object nor see or use her region.
  EXPECT_EQ(bob->RegisterSharedMemory("mine", a_buf->key(), 0, 16).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(bob->ListSharedMemory()->empty());
  EXPECT_EQ(bob->UnregisterSharedMemory("io").status().code(), absl::StatusCode::kNotFound);
  const std::string bobs = Module(*bob);
  v1::ForwardRequest req;
  req.set_module_id(bobs);
  *req.mutable_input() = *client::WriteShared(*a_buf, "io", 0, Random({2, kIn}), WireDType::kF32);
  auto r = bob->ForwardRaw(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  // Each tenant has its own count and names: Bob's "io" is his own.
  ASSERT_TRUE(bob->RegisterSharedMemory("io", b_buf->key(), 0, b_buf->size()).ok());
  ASSERT_TRUE(bob->RegisterSharedMemory("io2", b_buf->key(), 0, 16).ok());
  EXPECT_EQ(bob->RegisterSharedMemory("io3", b_buf->key(), 0, 16).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(alice->RegisterSharedMemory("io2", a_buf->key(), 0, 16).ok());
  *req.mutable_input() = *client::WriteShared(*b_buf, "io", 0, Random({2, kIn}), WireDType::kF32);
  EXPECT_TRUE(bob->ForwardRaw(req).ok());
  // Unregistering everything is per tenant too.
  EXPECT_EQ(*bob->UnregisterSharedMemory(), 2);
  EXPECT_EQ(alice->ListSharedMemory()->size(), 2u);
}

// The owner truncates its object: calls that need the missing bytes fail with FAILED_PRECONDITION
// and the server goes on (it never maps a client's object, so there is no SIGBUS to take).
TEST(SharedMemoryTest, TruncatedOrUnlinkedObjectCostsOnlyTheCall) {
  std::atomic<bool> shrink_before_compute{false};
  std::string key;
  TestServerOptions o = WithSharedMemory();
  o.configure = [&](rpc::ServiceOptions& options) {
    options.shared_memory.enabled = true;
    options.before_forward_compute = [&] {
      if (shrink_before_compute.exchange(false)) {
        const int fd = shm_open(key.c_str(), O_RDWR, 0);
        ASSERT_GE(fd, 0);
        ASSERT_EQ(ftruncate(fd, 100), 0);
        close(fd);
      }
    };
  };
  TestServer server(o);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string id = Module(*c);
  auto buffer = NewBuffer(1 << 16);
  key = buffer->key();
  ASSERT_TRUE(c->RegisterSharedMemory("io", key, 0, buffer->size()).ok());
  const HostTensor x = Random({4, kIn});
  v1::ForwardRequest req;
  req.set_module_id(id);
  req.set_training(true);
  *req.mutable_input() = *client::WriteShared(*buffer, "io", 0, x, WireDType::kF32);
  *req.mutable_output_shared_memory() = client::SharedRef("io", 32768, 4096);
  auto first = c->ForwardRaw(req);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(c->ReleaseContext(first->context_id()).ok());
  {
    // Unlinked by its owner: the server's descriptor keeps the object and its bytes.
    auto other = NewBuffer(4096);
    ASSERT_TRUE(c->RegisterSharedMemory("gone", other->key(), 0, 4096).ok());
    std::memcpy(other->data(), buffer->data(), 1024);
  }  // unmapped and unlinked here
  v1::ForwardRequest from_gone = req;
  from_gone.mutable_input()->mutable_shared_memory()->set_region("gone");
  from_gone.set_training(false);
  auto kept = c->ForwardRaw(from_gone);
  ASSERT_TRUE(kept.ok()) << kept.status();
  // Truncated after the input was read, before the output is written: the forward's context is
  // released, nothing is written.
  shrink_before_compute = true;
  auto late = c->ForwardRaw(req);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition) << late.status();
  EXPECT_EQ(server.host().Stats().live_contexts, 0);
  // Truncated before the call: the input read comes up short.
  auto early = c->ForwardRaw(req);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  EXPECT_EQ(server.host().Stats().live_contexts, 0);
  // The server goes on.
  EXPECT_TRUE(c->Forward(id, x, false).ok());
}

// A hostile owner resizes its object while forwards read from and write to it: every call answers
// OK or FAILED_PRECONDITION, the server survives, no context leaks.
TEST(SharedMemoryTest, ObjectResizedWhileCallsRun) {
  TestServer server(WithSharedMemory());
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string id = Module(*c);
  auto buffer = NewBuffer(1 << 20);
  ASSERT_TRUE(c->RegisterSharedMemory("io", buffer->key(), 0, buffer->size()).ok());
  v1::ForwardRequest req;
  req.set_module_id(id);
  req.set_training(true);
  *req.mutable_input() =
      *client::WriteShared(*buffer, "io", 0, Random({512, kIn}), WireDType::kF32);
  *req.mutable_output_shared_memory() = client::SharedRef("io", 1 << 19, 1 << 18);
  std::atomic<bool> stop{false};
  std::thread flipper([&] {
    const int fd = shm_open(buffer->key().c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    for (int i = 0; !stop; ++i) {
      (void)!ftruncate(fd, i % 2 ? off_t(buffer->size()) : off_t(64 << 10));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    (void)!ftruncate(fd, off_t(buffer->size()));
    close(fd);
  });
  int ok = 0, refused = 0;
  for (int i = 0; i < 200; ++i) {
    auto r = c->ForwardRaw(req);
    if (r.ok()) {
      ++ok;
      ASSERT_TRUE(c->ReleaseContext(r->context_id()).ok());
    } else {
      ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
      ++refused;
    }
  }
  stop = true;
  flipper.join();
  EXPECT_EQ(ok + refused, 200);
  EXPECT_EQ(server.host().Stats().live_contexts, 0);
  EXPECT_TRUE(c->ForwardRaw(req).ok());
}

TEST(SharedMemoryTest, RegionsCloseAtShutdown) {
  auto buffer = NewBuffer(4096);
  EXPECT_EQ(OpenOn(buffer->key()), 0);  // the client's mapping holds no descriptor
  {
    TestServer server(WithSharedMemory());
    ASSERT_TRUE(server.ok());
    auto c = server.Connect();
    ASSERT_TRUE(c->RegisterSharedMemory("a", buffer->key(), 0, 4096).ok());
    ASSERT_TRUE(c->RegisterSharedMemory("b", buffer->key(), 0, 1024).ok());
    EXPECT_EQ(server.service().shared_memory_regions(), 2);
    EXPECT_EQ(OpenOn(buffer->key()), 2);
    EXPECT_EQ(*c->UnregisterSharedMemory("b"), 1);
    EXPECT_EQ(OpenOn(buffer->key()), 1);
  }
  EXPECT_EQ(OpenOn(buffer->key()), 0);  // the server closed what was left at shutdown
}

}  // namespace
}  // namespace gradwire
