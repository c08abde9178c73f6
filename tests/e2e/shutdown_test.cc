// Graceful shutdown of the real gradwire-server binary: after SIGTERM new calls are refused while
// the forwards already in flight finish and answer; modules are checkpointed and the exit code
// is 0.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "gradwire/client/client.h"
#include "server_process.h"

namespace gradwire {
namespace {

using client::HostTensor;
using testing::ServerProcess;
using Clock = std::chrono::steady_clock;

HostTensor Random(std::vector<int64_t> shape) {
  thread_local std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> dist(0.0f, 1.0f);
  HostTensor t = HostTensor::Zeros(std::move(shape));
  for (float& v : t.data) v = dist(rng);
  return t;
}

// From the server's metrics endpoint: work waiting on the executor, and forwards (unary and
// chunked) finished OK; -1 each when unreadable.
struct Progress {
  int64_t queued = -1;
  int64_t forwards_ok = -1;
};
Progress ReadProgress(httplib::Client& http) {
  Progress p;
  auto res = http.Get("/metrics");
  if (!res || res->status != 200) return p;
  std::smatch m;
  if (std::regex_search(res->body, m, std::regex(R"(\ngradwire_executor_queued_tasks (\d+)\n)"))) {
    p.queued = std::stoll(m[1]);
  }
  p.forwards_ok = 0;
  const std::regex ok(R"(gradwire_rpc_total\{code="OK",method="Forward[A-Za-z]*"\} (\d+))");
  for (auto it = std::sregex_iterator(res->body.begin(), res->body.end(), ok);
       it != std::sregex_iterator(); ++it) {
    p.forwards_ok += std::stoll((*it)[1]);
  }
  return p;
}

std::unique_ptr<client::Client> Connect(const std::string& address) {
  client::ClientOptions options;
  options.server = address;
  options.timeout = std::chrono::seconds(120);
  auto c = std::make_unique<client::Client>(options);
  EXPECT_TRUE(c->WaitForReady(std::chrono::seconds(10)).ok());
  return c;
}

// A stop signal the kernel hands to a thread that does not block it (a library's thread started
// before main blocks the signals, as OpenBLAS's workers are) still shuts the server down
// cleanly: the thread passes it to main's sigwait instead of the default action killing the
// process. Sent to such a thread directly, so the test does not depend on the kernel's choice.
TEST(ShutdownTest, ASigtermOnAThreadThatDoesNotBlockItShutsDownCleanly) {
  char base[] = "/tmp/gradwire-sigthread-XXXXXX";
  ASSERT_NE(mkdtemp(base), nullptr);
  ServerProcess server(base, {});
  ASSERT_FALSE(server.address().empty());
  const pid_t pid = server.pid();
  pid_t target = 0;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  for (const auto& entry : std::filesystem::directory_iterator(tasks)) {
    const pid_t tid = pid_t(std::stol(entry.path().filename().string()));
    std::ifstream status(entry.path() / "status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("SigBlk:", 0) != 0) continue;
      const uint64_t blocked = std::stoull(line.substr(7), nullptr, 16);
      if (tid != pid && (blocked & (uint64_t(1) << (SIGTERM - 1))) == 0) target = tid;
    }
    if (target != 0) break;
  }
  if (target == 0) {
    server.Signal(SIGKILL);
    std::filesystem::remove_all(base);
    GTEST_SKIP() << "every server thread blocks SIGTERM here: no thread to hand it to";
  }
  ASSERT_EQ(syscall(SYS_tgkill, pid, target, SIGTERM), 0);
  EXPECT_EQ(server.Wait(), 0) << server.Log();
  EXPECT_NE(server.Log().find("received Terminated"), std::string::npos) << server.Log();
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(base);
}

TEST(ShutdownTest, SigtermRefusesNewCallsFinishesInFlightOnesAndCheckpoints) {
  char base[] = "/tmp/gradwire-shutdown-XXXXXX";
  ASSERT_NE(mkdtemp(base), nullptr);
  const std::string dir = std::string(base) + "/checkpoints";
  ServerProcess server(base, {"--checkpoint-dir", dir, "--shutdown-grace", "60", "--metrics-listen",
                              "127.0.0.1:0", "--max-tensor-elements", "134217728"});
  std::smatch port;
  const std::string start_log = server.Log();
  ASSERT_TRUE(
      std::regex_search(start_log, port, std::regex(R"(metrics on http://[0-9.]+:([0-9]+)/)")))
      << start_log;
  httplib::Client http("127.0.0.1", std::stoi(port[1]));
  auto c = Connect(server.address());
  v1::ModuleSpec spec;
  // A wide MLP: much compute per byte sent, so the four forwards below arrive long before the
  // first of them is done.
  spec.set_kind(v1::LAYERNORM_MLP);
  spec.set_in_features(512);
  spec.set_ffn_features(8192);
  spec.set_out_features(512);
  spec.set_seed(5);
  auto info = c->CreateModule(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  const std::string m = info->module_id();

  // Rows for a forward of about 2 s on this machine, so four of them queued back to back are
  // still running well after SIGTERM and the refused calls (which may take a while to fail on a
  // busy machine).
  // Each size is timed twice and the faster counts: a moment of load from a test running beside
  // this one must not stop the search early (the forwards below would then be over before any
  // waited on the executor).
  int64_t rows = 64;
  for (;;) {
    double s = 1e9;
    for (int attempt = 0; attempt < 2; ++attempt) {
      const auto t0 = Clock::now();
      const auto fwd = c->Forward(m, Random({rows, 512}), false);
      ASSERT_TRUE(fwd.ok()) << fwd.status();
      s = std::min(s, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    // 16384 rows: 32 MiB in, under --max-request-bytes; the FC1 output (16384 x 8192) is what
    // --max-tensor-elements allows this server.
    if (s > 2.0 || rows >= 16384) break;
    rows *= 2;
  }

  constexpr int kInFlight = 4;
  std::atomic<int> ok{0};
  std::vector<Clock::time_point> done(kInFlight);
  std::vector<absl::Status> outcome(kInFlight);
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<HostTensor> inputs;
  for (int i = 0; i < kInFlight; ++i) {
    clients.push_back(Connect(server.address()));
    // A first call teaches the client the module's shapes (it picks unary or chunked calls by
    // size); without it the flight's forward would first ask ListModules, which waits behind the
    // compute of the forwards sent before it.
    ASSERT_TRUE(clients.back()->Forward(m, Random({1, 512}), false).ok());
    inputs.push_back(Random({rows, 512}));
  }
  std::vector<std::thread> flights;
  // Joined on every way out, a failed assertion included (a joinable thread destroyed would end
  // the process instead of reporting the failure).
  struct JoinAll {
    std::vector<std::thread>& threads;
    ~JoinAll() {
      for (auto& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } join_all{flights};
  for (int i = 0; i < kInFlight; ++i) {
    flights.emplace_back([&, i] {
      auto r = clients[i]->Forward(m, inputs[i], true);
      outcome[i] = r.status();
      if (r.ok()) {
        EXPECT_EQ(r->output.shape, (std::vector<int64_t>{rows, 512}));
        EXPECT_EQ(r->context_id.size(), 32u);
        ++ok;
      }
      done[i] = Clock::now();
    });
  }
  // SIGTERM once forwards wait on the executor behind the one computing, two or more. (A
  // fixed sleep is not enough on a busy machine. On 2 cores the compute can starve gRPC's threads,
  // so a forward may not arrive until the one before it is done; after 5 s, one queued is enough.)
  // The queue is the unambiguous sign: finished counts lag for chunked calls (counted once the
  // response is sent) and lead for unary ones (counted before the next starts).
  const auto flights_sent = Clock::now();
  std::string seen;  // queued/forwards finished samples, for the failure message
  int64_t queued_at_sigterm = 0;
  while (Clock::now() - flights_sent < std::chrono::seconds(90)) {
    const Progress p = ReadProgress(http);
    seen += std::to_string(p.queued) + "/" + std::to_string(p.forwards_ok) + " ";
    if (p.queued >= kInFlight - 2 ||
        (p.queued >= 1 && Clock::now() - flights_sent > std::chrono::seconds(5))) {
      queued_at_sigterm = p.queued;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(queued_at_sigterm, 1) << "no forward waited on the executor; queued/forwards finished: "
                                  << seen;
  server.Send(SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // A new call now is refused: on a new connection and on the existing one.
  client::ClientOptions options;
  options.server = server.address();
  options.timeout = std::chrono::seconds(5);
  client::Client late(options);
  auto fresh = late.Forward(m, Random({4, 512}), true);
  EXPECT_FALSE(fresh.ok());
  EXPECT_EQ(fresh.status().code(), absl::StatusCode::kUnavailable) << fresh.status();
  auto again = c->Forward(m, Random({4, 512}), true);
  EXPECT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  const auto refused_done = Clock::now();

  for (auto& t : flights) t.join();
  // Every forward the server had accepted finished and answered: at least the queued ones and
  // the one computing. One still on its way at SIGTERM may be refused, and only as unavailable.
  EXPECT_GE(ok.load(), queued_at_sigterm + 1);
  for (const absl::Status& st : outcome) {
    if (!st.ok()) EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  }
  // The refusals happened while the in-flight forwards were still running.
  const auto last = *std::max_element(done.begin(), done.end());
  EXPECT_GT(last, refused_done) << "the in-flight forwards ended before the refused call; "
                                   "the test did not overlap them";
  EXPECT_EQ(server.Wait(), 0) << server.Log();
  const std::string log = server.Log();
  EXPECT_NE(log.find("checkpointed 1 modules"), std::string::npos) << log;
  EXPECT_TRUE(std::filesystem::exists(dir)) << log;
  bool found = false;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    found |= entry.path().string().find(m) != std::string::npos;
  }
  EXPECT_TRUE(found) << "no checkpoint of module " << m << " in " << dir;
  std::filesystem::remove_all(base);
}

}  // namespace
}  // namespace gradwire
