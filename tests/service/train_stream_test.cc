// The Train bidi stream, over TCP loopback and in-process: pipelining, request ids, per-request
// errors, bounded read-ahead, and contexts released when the stream ends or is cancelled.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

#include "gradwire/client/client.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire {
namespace {

using client::HostTensor;

using testing::Random;
using testing::WaitFor;
class TrainStreamTest : public ::testing::TestWithParam<testing::Transport> {
 protected:
  void SetUp() override { Start(8); }
  void Start(int read_ahead) {
    client_.reset();
    testing::TestServerOptions o;
    o.stream_read_ahead = read_ahead;
    o.transport = GetParam();
    server_ = std::make_unique<testing::TestServer>(o);
    ASSERT_TRUE(server_->ok());
    client_ = server_->Connect();
    v1::ModuleSpec spec = testing::LinearSpec(32, 16, true, 11);
    auto info = client_->CreateModule(spec);
    ASSERT_TRUE(info.ok()) << info.status();
    module_ = info->module_id();
  }
  int64_t LiveContexts() { return server_->host().Stats().live_contexts; }

  std::unique_ptr<testing::TestServer> server_;
  std::unique_ptr<client::Client> client_;
  std::string module_;
};

TEST_P(TrainStreamTest, PipelinedMicrobatchesMatchUnaryCalls) {
  constexpr int kMicro = 6;
  std::vector<HostTensor> xs, dys;
  for (int i = 0; i < kMicro; ++i) {
    xs.push_back(Random({4, 32}));
    dys.push_back(Random({4, 16}));
  }
  auto stream = client_->OpenTrainStream();
  // All forwards first, without waiting: the server pipelines them.
  for (int i = 0; i < kMicro; ++i) ASSERT_TRUE(stream->SendForward(100 + i, module_, xs[i], true));
  std::map<uint64_t, v1::TrainResponse> forwards;
  for (int i = 0; i < kMicro; ++i) {
    auto r = stream->Read();
    ASSERT_TRUE(r.has_value());
    ASSERT_EQ(r->code(), 0) << r->message();
    ASSERT_TRUE(r->has_forward());
    forwards[r->request_id()] = *r;
  }
  ASSERT_EQ(forwards.size(), size_t(kMicro));
  EXPECT_EQ(LiveContexts(), kMicro);
  for (int i = 0; i < kMicro; ++i) {
    ASSERT_TRUE(stream->SendBackward(200 + i, forwards[100 + i].forward().context_id(), dys[i]));
  }
  std::map<uint64_t, v1::TrainResponse> backwards;
  for (int i = 0; i < kMicro; ++i) {
    auto r = stream->Read();
    ASSERT_TRUE(r.has_value());
    ASSERT_EQ(r->code(), 0) << r->message();
    backwards[r->request_id()] = *r;
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(LiveContexts(), 0);

  // The same micro-batches through unary calls on the same weights give the same bits.
  for (int i = 0; i < kMicro; ++i) {
    auto fwd = client_->Forward(module_, xs[i], true);
    ASSERT_TRUE(fwd.ok());
    auto streamed = client::FromWire(forwards[100 + i].forward().output());
    ASSERT_TRUE(streamed.ok());
    EXPECT_EQ(streamed->data, fwd->output.data) << "micro-batch " << i;
    auto dx = client_->Backward(fwd->context_id, dys[i]);
    ASSERT_TRUE(dx.ok());
    auto streamed_dx = client::FromWire(backwards[200 + i].backward().grad_input());
    ASSERT_TRUE(streamed_dx.ok());
    EXPECT_EQ(streamed_dx->data, dx->data) << "micro-batch " << i;
  }
}

TEST_P(TrainStreamTest, AFailedRequestAnswersWithItsStatusAndTheStreamGoesOn) {
  auto stream = client_->OpenTrainStream();
  ASSERT_TRUE(stream->SendForward(1, module_, Random({4, 31}), true));  // wrong width
  ASSERT_TRUE(stream->SendForward(2, std::string(32, 'a'), Random({4, 32}), true));
  ASSERT_TRUE(stream->SendBackward(3, "0123456789abcdef0123456789abcdef", Random({4, 16})));
  v1::TrainRequest empty;
  empty.set_request_id(4);
  ASSERT_TRUE(stream->Send(empty));
  ASSERT_TRUE(stream->SendForward(5, module_, Random({4, 32}), false));
  std::map<uint64_t, v1::TrainResponse> got;
  for (int i = 0; i < 5; ++i) {
    auto r = stream->Read();
    ASSERT_TRUE(r.has_value());
    got[r->request_id()] = *r;
  }
  EXPECT_EQ(got[1].code(), int(grpc::StatusCode::INVALID_ARGUMENT)) << got[1].message();
  EXPECT_EQ(got[2].code(), int(grpc::StatusCode::NOT_FOUND));
  EXPECT_EQ(got[3].code(), int(grpc::StatusCode::NOT_FOUND));
  EXPECT_EQ(got[4].code(), int(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(got[4].message().find("forward, backward or release"), std::string::npos);
  EXPECT_EQ(got[5].code(), 0);
  EXPECT_TRUE(got[5].has_forward());
  EXPECT_FALSE(got[1].has_forward());
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(LiveContexts(), 0);
}

TEST_P(TrainStreamTest, EndingTheStreamReleasesItsUnconsumedContexts) {
  auto stream = client_->OpenTrainStream();
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(stream->SendForward(i, module_, Random({2, 32}), true));
  std::vector<std::string> contexts;
  for (int i = 0; i < 5; ++i) {
    auto r = stream->Read();
    ASSERT_TRUE(r.has_value() && r->code() == 0);
    contexts.push_back(r->forward().context_id());
  }
  // One consumed on the stream, one released on it, one by a unary backward elsewhere.
  ASSERT_TRUE(stream->SendBackward(10, contexts[0], Random({2, 16})));
  v1::TrainRequest release;
  release.set_request_id(11);
  release.mutable_release()->set_context_id(contexts[1]);
  ASSERT_TRUE(stream->Send(release));
  for (int i = 0; i < 2; ++i) {
    auto r = stream->Read();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->code(), 0) << r->message();
  }
  ASSERT_TRUE(client_->Backward(contexts[2], Random({2, 16})).ok());
  EXPECT_EQ(LiveContexts(), 2);
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_TRUE(WaitFor([&] { return LiveContexts() == 0; }));
  // A backward after the stream says where its context went.
  const absl::Status late = client_->Backward(contexts[3], Random({2, 16})).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(late.message()).find("Train stream that made it ended"), std::string::npos)
      << late;
}

TEST_P(TrainStreamTest, CancellingTheStreamReleasesItsContexts) {
  auto stream = client_->OpenTrainStream();
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(stream->SendForward(i, module_, Random({2, 32}), true));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(stream->Read().has_value());
  EXPECT_EQ(LiveContexts(), 4);
  stream->Cancel();
  EXPECT_FALSE(stream->Finish().ok());
  EXPECT_TRUE(WaitFor([&] { return LiveContexts() == 0; }));
  EXPECT_TRUE(WaitFor([&] { return server_->service().streams_open() == 0; }));
  // The server still serves.
  EXPECT_TRUE(client_->Forward(module_, Random({2, 32}), false).ok());
}

// With the executor held, the server reads only `read_ahead` requests however many the client
// writes; released, it answers all of them.
TEST_P(TrainStreamTest, ReadAheadIsBounded) {
  Start(3);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  server_->executor().Submit([&] {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return release; });
  });
  auto stream = client_->OpenTrainStream();
  const int64_t before = server_->service().stream_requests_read();
  std::thread writer([&] {
    for (int i = 0; i < 40; ++i) {
      if (!stream->SendForward(i, module_, Random({1, 32}), false)) return;
    }
  });
  // The server reads three; then, however long the transport has to deliver more, no more.
  EXPECT_TRUE(WaitFor([&] { return server_->service().stream_requests_read() - before >= 3; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(server_->service().stream_requests_read() - before, 3);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  // Read while the writer still writes: a transport without buffers of its own (in-process)
  // takes a new request only as the server reads, and the server reads only as responses go out.
  int answered = 0;
  std::set<uint64_t> ids;
  while (answered < 40) {
    auto r = stream->Read();
    if (!r.has_value()) break;
    EXPECT_EQ(r->code(), 0);
    ids.insert(r->request_id());
    ++answered;
  }
  writer.join();
  EXPECT_EQ(answered, 40);
  EXPECT_EQ(ids.size(), 40u);
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(server_->service().stream_requests_read() - before, 40);
}

INSTANTIATE_TEST_SUITE_P(Transports, TrainStreamTest,
                         ::testing::Values(testing::Transport::kTcp,
                                           testing::Transport::kInProcess),
                         testing::TransportParamName);

}  // namespace
}  // namespace gradwire
