// The chunked calls: the wire helpers on their own, then ForwardChunked / BackwardChunked /
// GetWeightsChunked / SetWeightsChunked over loopback -- same results as the unary calls, the
// client's choice of call, and every malformed chunk sequence refused with nothing left behind.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <string>

#include "gradwire/wire/chunking.h"
#include "tests/service/specs.h"
#include "tests/service/test_server.h"

namespace gradwire {
namespace {

using testing::Random;
using testing::TestServer;

constexpr int64_t kChunk = 64 << 10;     // the test server's --chunk-kib 64
constexpr int64_t kMaxStream = 8 << 20;  // and --max-stream-mib 8

std::string RandomBytes(size_t n) {
  thread_local std::mt19937 rng(std::random_device{}());
  std::string s(n, '\0');
  for (char& c : s) c = char(rng());
  return s;
}

v1::Tensor F32Tensor(std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(v1::F32);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  // Standard-normal floats (random bytes would hold NaNs, which the server refuses).
  thread_local std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal;
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = normal(rng);
  t.set_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return t;
}

// --- The wire helpers --------------------------------------------------------------------------

TEST(ChunkingTest, SplitThenAssembleGivesTheSameBytes) {
  v1::SetWeightsRequest sent;
  sent.set_module_id("m");
  for (auto shape : {std::vector<int64_t>{37, 129}, {1}, {3, 5, 7}, {1000}}) {
    v1::NamedTensor* n = sent.add_parameters();
    n->set_name("p" + std::to_string(sent.parameters_size()));
    *n->mutable_tensor() = F32Tensor(shape);
  }
  const v1::SetWeightsRequest original = sent;
  for (int64_t chunk : {int64_t(1000), int64_t(4096), int64_t(1) << 20}) {
    v1::SetWeightsRequest header = original;
    wire::ChunkSplitter splitter(wire::Slots(header), chunk);
    EXPECT_EQ(splitter.total_bytes(), (37 * 129 + 1 + 105 + 1000) * 4);
    for (const v1::NamedTensor& n : header.parameters()) EXPECT_TRUE(n.tensor().data().empty());
    v1::SetWeightsRequest received = header;
    wire::ChunkAssembler assembler;
    ASSERT_TRUE(assembler.Start(wire::Slots(received), kMaxStream, "limit", chunk).ok());
    v1::TensorChunk c;
    int chunks = 0;
    while (splitter.Next(&c)) {
      ASSERT_LE(int64_t(c.data().size()), chunk);
      ASSERT_TRUE(assembler.Add(c).ok()) << "chunk " << chunks;
      ++chunks;
    }
    ASSERT_TRUE(assembler.Complete().ok());
    EXPECT_GE(chunks, 4);
    EXPECT_EQ(received.SerializeAsString(), original.SerializeAsString()) << "chunk " << chunk;
  }
}

TEST(ChunkingTest, AssemblerRefusesEveryMalformedSequence) {
  v1::ForwardRequest base;
  *base.mutable_input() = F32Tensor({16, 64});  // 4096 bytes
  base.mutable_input()->clear_data();
  auto start = [&](v1::ForwardRequest* req, wire::ChunkAssembler* a) {
    *req = base;
    return a->Start(wire::Slots(*req), kMaxStream, "--max-stream-mib", 1024);
  };
  auto chunk = [](uint32_t tensor, uint64_t offset, size_t n) {
    v1::TensorChunk c;
    c.set_tensor(tensor);
    c.set_offset(offset);
    c.set_data(RandomBytes(n));
    return c;
  };
  struct Case {
    const char* name;
    std::vector<v1::TensorChunk> chunks;  // the last one is the bad one
    const char* message;
  };
  const std::vector<Case> cases = {
      {"empty", {chunk(0, 0, 0)}, "is empty"},
      {"oversize", {chunk(0, 0, 1025)}, "larger than the chunk limit"},
      {"wrong tensor", {chunk(1, 0, 10)}, "arrived while tensor 0 (input)"},
      {"repeated", {chunk(0, 0, 1024), chunk(0, 0, 1024)}, "those bytes already arrived"},
      {"gap", {chunk(0, 0, 1024), chunk(0, 2048, 1024)}, "bytes are missing"},
      {"past the end",
       {chunk(0, 0, 1024), chunk(0, 1024, 1024), chunk(0, 2048, 1024), chunk(0, 3072, 1000),
        chunk(0, 4072, 100)},
       "runs past its end"},
      {"after the last byte",
       {chunk(0, 0, 1024), chunk(0, 1024, 1024), chunk(0, 2048, 1024), chunk(0, 3072, 1024),
        chunk(0, 4096, 1)},
       "arrived after all 4096 bytes"},
  };
  for (const Case& c : cases) {
    v1::ForwardRequest req;
    wire::ChunkAssembler a;
    ASSERT_TRUE(start(&req, &a).ok());
    for (size_t i = 0; i + 1 < c.chunks.size(); ++i) ASSERT_TRUE(a.Add(c.chunks[i]).ok()) << c.name;
    absl::Status s = a.Add(c.chunks.back());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << c.name << ": " << s.message();
  }
  {  // ends early
    v1::ForwardRequest req;
    wire::ChunkAssembler a;
    ASSERT_TRUE(start(&req, &a).ok());
    ASSERT_TRUE(a.Add(chunk(0, 0, 1024)).ok());
    absl::Status s = a.Complete();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("input has 1024 of 4096 bytes"), std::string::npos) << s.message();
  }
  {  // header with data
    v1::ForwardRequest req = base;
    req.mutable_input()->set_data("abcd");
    wire::ChunkAssembler a;
    absl::Status s = a.Start(wire::Slots(req), kMaxStream, "--max-stream-mib", 1024);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("input.data must be empty"), std::string::npos) << s.message();
  }
  {  // too big in all
    v1::ForwardRequest req = base;
    req.mutable_input()->set_shape(0, 1 << 20);  // 256 MiB of F32
    wire::ChunkAssembler a;
    absl::Status s = a.Start(wire::Slots(req), kMaxStream, "--max-stream-mib", 1024);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(s.message().find("--max-stream-mib"), std::string::npos) << s.message();
    EXPECT_TRUE(req.input().data().empty()) << "nothing is allocated for a refused header";
  }
}

// --- Over TCP loopback and in-process ------------------------------------------------------------

class ChunkedServiceTest : public ::testing::TestWithParam<testing::Transport> {
 protected:
  static testing::TestServerOptions Options() {
    testing::TestServerOptions o;
    o.configure = [](rpc::ServiceOptions& s) {
      s.chunk_bytes = kChunk;
      s.max_stream_bytes = kMaxStream;
    };
    o.transport = GetParam();
    return o;
  }

  std::unique_ptr<client::Client> Connect(client::ClientOptions::Chunking chunking) {
    client::ClientOptions o;
    o.chunk_kib = int(kChunk >> 10);
    o.chunking = chunking;
    // The wire's paths under test: over TCP on this host the client would otherwise pass these
    // tensors through shared memory (shared_memory_test covers that).
    o.shared_memory = client::ClientOptions::SharedMemory::kOff;
    // F32: the sizes these tests pick are float32's (the exact wire, the default, would send a
    // Linear's input as E4M3 codes, a quarter of them).
    o.wire_dtype = client::WireDType::kF32;
    return server_.Connect(std::move(o));
  }

  std::string CreateLinear(client::Client& c, int64_t in, int64_t out) {
    v1::ModuleSpec spec = testing::LinearSpec(in, out, true, 7);
    auto info = c.CreateModule(spec);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->module_id() : "";
  }

  int64_t LiveContexts() { return server_.host().Stats().live_contexts; }

  TestServer server_{Options()};
};

TEST_P(ChunkedServiceTest, ForwardAndBackwardGiveTheUnaryResults) {
  auto unary = Connect(client::ClientOptions::Chunking::kNever);
  auto chunked = Connect(client::ClientOptions::Chunking::kAlways);
  const std::string id = CreateLinear(*unary, 256, 384);
  const client::HostTensor x = Random({300, 256});  // 300 KiB in, 450 KiB out: several chunks
  const client::HostTensor dy = Random({300, 384});

  auto a = unary->Forward(id, x, /*training=*/true);
  auto b = chunked->Forward(id, x, /*training=*/true);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->output.shape, b->output.shape);
  EXPECT_EQ(a->output.data, b->output.data);  // bit for bit: same bytes, same compute
  EXPECT_EQ(LiveContexts(), 2);

  auto ga = unary->Backward(a->context_id, dy);
  auto gb = chunked->Backward(b->context_id, dy);
  ASSERT_TRUE(ga.ok()) << ga.status();
  ASSERT_TRUE(gb.ok()) << gb.status();
  EXPECT_EQ(ga->shape, (std::vector<int64_t>{300, 256}));
  EXPECT_EQ(ga->data, gb->data);
  EXPECT_EQ(LiveContexts(), 0);
  EXPECT_EQ(unary->chunked_calls(), 0);
  EXPECT_EQ(chunked->chunked_calls(), 2);  // its forward and its backward
}

TEST_P(ChunkedServiceTest, ClientPicksTheCallBySize) {
  auto c = Connect(client::ClientOptions::Chunking::kAuto);
  const std::string narrow = CreateLinear(*c, 64, 32);
  const std::string wide = CreateLinear(*c, 16, 4096);

  ASSERT_TRUE(c->Forward(narrow, Random({4, 64}), false).ok());  // 1 KiB each way
  EXPECT_EQ(c->chunked_calls(), 0);
  auto big_in = c->Forward(narrow, Random({512, 64}), false);  // 128 KiB in, 64 KiB out
  ASSERT_TRUE(big_in.ok()) << big_in.status();
  EXPECT_EQ(c->chunked_calls(), 1);
  EXPECT_EQ(big_in->output.shape, (std::vector<int64_t>{512, 32}));
  // 512 bytes in, 128 KiB out: the response decides.
  auto big_out = c->Forward(wide, Random({8, 16}), true);
  ASSERT_TRUE(big_out.ok()) << big_out.status();
  EXPECT_EQ(c->chunked_calls(), 2);
  // Its backward sends 128 KiB: chunked; a small backward of another context is not.
  ASSERT_TRUE(c->Backward(big_out->context_id, Random({8, 4096})).ok());
  EXPECT_EQ(c->chunked_calls(), 3);
  auto small = c->Forward(narrow, Random({4, 64}), true);
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE(c->Backward(small->context_id, Random({4, 32})).ok());
  EXPECT_EQ(c->chunked_calls(), 3);
  // Weights: `wide` has 16*4096+4096 floats (272 KiB): chunked both ways; `narrow` is small.
  auto w = c->GetWeights(wide);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(c->chunked_calls(), 4);
  ASSERT_TRUE(c->SetWeights(wide, w->tensors).ok());
  EXPECT_EQ(c->chunked_calls(), 5);
  ASSERT_TRUE(c->GetWeights(narrow).ok());
  EXPECT_EQ(c->chunked_calls(), 5);
}

TEST_P(ChunkedServiceTest, WeightsRoundTripThroughChunks) {
  auto unary = Connect(client::ClientOptions::Chunking::kNever);
  auto chunked = Connect(client::ClientOptions::Chunking::kAlways);
  const std::string id = CreateLinear(*unary, 300, 200);  // 234 KiB of weight
  std::vector<std::pair<std::string, client::HostTensor>> params = {{"weight", Random({200, 300})},
                                                                    {"bias", Random({200})}};
  auto v = chunked->SetWeights(id, params);
  ASSERT_TRUE(v.ok()) << v.status();
  auto via_unary = unary->GetWeights(id);
  auto via_chunks = chunked->GetWeights(id);
  ASSERT_TRUE(via_unary.ok()) << via_unary.status();
  ASSERT_TRUE(via_chunks.ok()) << via_chunks.status();
  EXPECT_EQ(via_chunks->weight_version, *v);
  for (const auto& [name, t] : params) {
    ASSERT_NE(via_chunks->Find(name), nullptr) << name;
    EXPECT_EQ(via_chunks->Find(name)->data, t.data) << name;
    EXPECT_EQ(via_unary->Find(name)->data, t.data) << name;
  }
}

// A hand-driven ForwardChunked call: `parts` are written in order, then the stream half-closes.
grpc::Status SendForwardParts(TestServer& server, const std::vector<v1::ForwardRequestPart>& parts,
                              v1::ForwardResponse* response = nullptr) {
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Gradwire::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto stream = stub->ForwardChunked(&ctx);
  for (const auto& p : parts) {
    if (!stream->Write(p)) break;  // the server may finish early
  }
  stream->WritesDone();
  v1::ForwardResponsePart part;
  while (stream->Read(&part)) {
    if (response && part.has_header()) *response = part.header();
  }
  return stream->Finish();
}

TEST_P(ChunkedServiceTest, MalformedSequencesAreRefusedAndLeaveNothing) {
  auto c = Connect(client::ClientOptions::Chunking::kNever);
  const std::string id = CreateLinear(*c, 128, 64);
  const v1::Tensor full = F32Tensor({256, 128});  // 128 KiB: two chunks of 64 KiB
  v1::ForwardRequestPart header;
  header.mutable_header()->set_module_id(id);
  header.mutable_header()->set_training(true);
  *header.mutable_header()->mutable_input() = full;
  header.mutable_header()->mutable_input()->clear_data();
  auto chunk = [&](uint32_t tensor, uint64_t offset, size_t n) {
    v1::ForwardRequestPart p;
    p.mutable_chunk()->set_tensor(tensor);
    p.mutable_chunk()->set_offset(offset);
    p.mutable_chunk()->set_data(
        full.data().substr(std::min<size_t>(offset, full.data().size()), n));
    if (p.chunk().data().size() < n) p.mutable_chunk()->mutable_data()->resize(n, 'x');
    return p;
  };
  const size_t half = size_t(kChunk);
  v1::ForwardRequestPart with_data = header;
  with_data.mutable_header()->mutable_input()->set_data("x");
  v1::ForwardRequestPart neither;
  v1::ForwardRequestPart huge = header;
  huge.mutable_header()->mutable_input()->set_shape(0, 1 << 17);  // 64 MiB of F32

  struct Case {
    const char* name;
    std::vector<v1::ForwardRequestPart> parts;
    grpc::StatusCode code;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"no messages", {}, grpc::INVALID_ARGUMENT, "ended before its header"},
      {"chunk first", {chunk(0, 0, half)}, grpc::INVALID_ARGUMENT, "must be the header"},
      {"neither", {neither}, grpc::INVALID_ARGUMENT, "must set header or chunk"},
      {"header twice", {header, header}, grpc::INVALID_ARGUMENT, "header was sent twice"},
      {"header with data", {with_data}, grpc::INVALID_ARGUMENT, "input.data must be empty"},
      {"missing chunk", {header, chunk(0, 0, half)}, grpc::INVALID_ARGUMENT, "ended early"},
      {"repeated chunk",
       {header, chunk(0, 0, half), chunk(0, 0, half)},
       grpc::INVALID_ARGUMENT,
       "already arrived"},
      {"out of order",
       {header, chunk(0, half, half), chunk(0, 0, half)},
       grpc::INVALID_ARGUMENT,
       "bytes are missing"},
      {"oversize chunk",
       {header, chunk(0, 0, half + 1)},
       grpc::INVALID_ARGUMENT,
       "larger than the chunk limit"},
      {"wrong tensor",
       {header, chunk(1, 0, half)},
       grpc::INVALID_ARGUMENT,
       "while tensor 0 (input)"},
      {"past the end",
       {header, chunk(0, 0, half), chunk(0, half, half), chunk(0, 2 * half, 1)},
       grpc::INVALID_ARGUMENT,
       "arrived after all"},
      {"too big in all", {huge, chunk(0, 0, half)}, grpc::RESOURCE_EXHAUSTED, "--max-stream-mib"},
  };
  for (const Case& k : cases) {
    const grpc::Status s = SendForwardParts(server_, k.parts);
    EXPECT_EQ(s.error_code(), k.code) << k.name << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(k.message), std::string::npos)
        << k.name << ": " << s.error_message();
    EXPECT_EQ(LiveContexts(), 0) << k.name;
  }
  // The same call done right works, and leaves exactly its context.
  v1::ForwardResponse response;
  const grpc::Status ok =
      SendForwardParts(server_, {header, chunk(0, 0, half), chunk(0, half, half)}, &response);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_FALSE(response.context_id().empty());
  EXPECT_EQ(response.output().shape_size(), 2);
  EXPECT_EQ(LiveContexts(), 1);
}

TEST_P(ChunkedServiceTest, RefusedSetWeightsChangesNothing) {
  auto c = Connect(client::ClientOptions::Chunking::kNever);
  const std::string id = CreateLinear(*c, 128, 256);
  auto before = c->GetWeights(id);
  ASSERT_TRUE(before.ok());
  auto channel = server_.Channel();
  auto stub = v1::Gradwire::NewStub(channel);
  grpc::ClientContext ctx;
  v1::SetWeightsResponse resp;
  auto stream = stub->SetWeightsChunked(&ctx, &resp);
  v1::SetWeightsRequestPart header;
  header.mutable_header()->set_module_id(id);
  v1::NamedTensor* w = header.mutable_header()->add_parameters();
  w->set_name("weight");
  *w->mutable_tensor() = F32Tensor({256, 128});
  const std::string bytes = w->tensor().data();
  w->mutable_tensor()->clear_data();
  ASSERT_TRUE(stream->Write(header));
  v1::SetWeightsRequestPart first;
  first.mutable_chunk()->set_tensor(0);
  first.mutable_chunk()->set_offset(0);
  first.mutable_chunk()->set_data(bytes.substr(0, size_t(kChunk)));
  ASSERT_TRUE(stream->Write(first));
  stream->WritesDone();  // one chunk short
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << s.error_message();
  auto after = c->GetWeights(id);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->weight_version, before->weight_version);
  EXPECT_EQ(after->Find("weight")->data, before->Find("weight")->data);
}

// Opens a training ForwardChunked call and sends a whole request of `rows` x `in`.
std::unique_ptr<grpc::ClientReaderWriter<v1::ForwardRequestPart, v1::ForwardResponsePart>>
StartForward(v1::Gradwire::Stub& stub, grpc::ClientContext* ctx, const std::string& module_id,
             int64_t rows, int64_t in) {
  auto stream = stub.ForwardChunked(ctx);
  v1::ForwardRequest req;
  req.set_module_id(module_id);
  req.set_training(true);
  *req.mutable_input() = F32Tensor({rows, in});
  wire::ChunkSplitter splitter(wire::Slots(req), kChunk);
  v1::ForwardRequestPart part;
  *part.mutable_header() = req;
  EXPECT_TRUE(stream->Write(part));
  part.Clear();
  while (splitter.Next(part.mutable_chunk())) EXPECT_TRUE(stream->Write(part));
  stream->WritesDone();
  return stream;
}

TEST_P(ChunkedServiceTest, ForwardCancelledWhileQueuedIsNotRun) {
  auto c = Connect(client::ClientOptions::Chunking::kNever);
  const std::string id = CreateLinear(*c, 512, 512);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  server_.executor().Submit([&] {  // holds the device until the call is cancelled
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return release; });
  });
  auto stub = v1::Gradwire::NewStub(server_.Channel());
  grpc::ClientContext ctx;
  auto stream = StartForward(*stub, &ctx, id, 1024, 512);
  ctx.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::CANCELLED);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  EXPECT_TRUE(c->Forward(id, Random({2, 512}), false).ok());  // queued after it: it has run
  EXPECT_EQ(LiveContexts(), 0);
}

TEST_P(ChunkedServiceTest, UndeliveredResponseReleasesItsContext) {
  auto c = Connect(client::ClientOptions::Chunking::kNever);
  // 1 MiB in, 32 MiB out: more than the transport buffers, so the server is still writing when
  // the client, having read only the header, cancels.
  const std::string id = CreateLinear(*c, 16, 512);
  auto stub = v1::Gradwire::NewStub(server_.Channel());
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext ctx;
    auto stream = StartForward(*stub, &ctx, id, 16384, 16);
    v1::ForwardResponsePart header;
    ASSERT_TRUE(stream->Read(&header));
    ASSERT_TRUE(header.has_header());
    EXPECT_FALSE(header.header().context_id().empty());
    ctx.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::CANCELLED);
    EXPECT_TRUE(testing::WaitFor([&] { return LiveContexts() == 0; }))
        << "round " << i << ": the undelivered forward's context is still there";
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, ChunkedServiceTest,
                         ::testing::Values(testing::Transport::kTcp,
                                           testing::Transport::kInProcess),
                         testing::TransportParamName);

}  // namespace
}  // namespace gradwire
