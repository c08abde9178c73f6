// gradwire-soak: N concurrent clients against a running gradwire-server for a fixed time, mixing
// training steps, inference, abandoned contexts (never backwarded, never released), calls
// cancelled mid-flight (short deadlines and explicit cancels), weight uploads and optimizer steps.
// Fails (exit 1) when
//   - any call ends with a status its kind of call cannot legitimately get (OK everywhere;
//     CANCELLED / DEADLINE_EXCEEDED only for the calls it cancels),
//   - the server's live context bytes ever exceed the context budget (read from the metrics
//     endpoint under a configurable name, or given with --budget-bytes),
//   - more contexts are live at the end than the clients abandoned: a cancelled forward names its
//     context (ForwardRequest.context_id) and releases it when its answer never came, as the
//     client library does, so none stays behind,
//   - the server's RSS at the end is more than --rss-growth above its RSS after the warm-up, not
//     counting what live contexts hold on purpose (saved tensors on the device and host, and the
//     weight versions they keep: gradwire_context_bytes and gradwire_pinned_weight_bytes) beyond
//     what they held at the warm-up.
// scripts/soak.sh starts the server and runs this.
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gradwire/client/client.h"

namespace {

using gradwire::client::Client;
using gradwire::client::HostTensor;
namespace v1 = gradwire::v1;
using Clock = std::chrono::steady_clock;

struct Flags {
  std::string server;
  int server_pid = 0;
  std::string metrics;  // host:port of the Prometheus endpoint; empty: none
  int clients = 8;
  double seconds = 60;
  double warmup_seconds = 0;  // 0: half of --seconds, between 10 and 120 s
  double abandon = 0.10;
  double cancel = 0.05;
  double weight_updates = 0.02;
  double optimizer_steps = 0.03;
  double inference = 0.10;
  double rss_growth = 0.05;
  double release_abandoned_after = 5;  // 0: never (the server's budget or TTL must evict them)
  // Metric selectors as the exposition writes them (name and labels).
  std::string bytes_metric = "gradwire_context_bytes{memory=\"device\"}";
  std::string budget_metric = "gradwire_context_budget_bytes{memory=\"device\"}";
  std::vector<std::string> held_metrics = {"gradwire_context_bytes{memory=\"device\"}",
                                           "gradwire_context_bytes{memory=\"host\"}",
                                           "gradwire_pinned_weight_bytes"};
  int64_t budget_bytes = 0;
  int64_t in_features = 256, out_features = 256, ffn_features = 512, rows = 16;
  uint64_t seed = 0;
};

HostTensor Random(std::mt19937& rng, std::vector<int64_t> shape) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  HostTensor t = HostTensor::Zeros(std::move(shape));
  for (float& v : t.data) v = dist(rng);
  return t;
}

int64_t RssKiB(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// The value of an unlabelled sample `name` in a Prometheus text exposition.
std::optional<double> MetricValue(const std::string& text, const std::string& name) {
  size_t pos = 0;
  while ((pos = text.find(name, pos)) != std::string::npos) {
    const bool line_start = pos == 0 || text[pos - 1] == '\n';
    const size_t after = pos + name.size();
    if (line_start && after < text.size() && text[after] == ' ') {
      return std::strtod(text.c_str() + after + 1, nullptr);
    }
    pos = after;
  }
  return std::nullopt;
}

// Counts of every (operation, status code) the clients saw, and the failures among them.
class Tally {
 public:
  void Add(const std::string& op, grpc::StatusCode code, bool allowed, const std::string& msg) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[op + " " + CodeName(code)];
    if (!allowed && unexpected_.size() < 20) {
      unexpected_.push_back(op + ": " + CodeName(code) + " " + msg);
    }
    if (!allowed) ++unexpected_total_;
  }
  void Print() const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [k, n] : counts_)
      std::printf("soak:   %-34s %10lld\n", k.c_str(), (long long)n);
    for (const std::string& u : unexpected_) std::printf("soak: UNEXPECTED %s\n", u.c_str());
  }
  int64_t unexpected() const {
    std::lock_guard<std::mutex> lock(mu_);
    return unexpected_total_;
  }
  static std::string CodeName(grpc::StatusCode c) {
    static const char* kNames[] = {"OK",
                                   "CANCELLED",
                                   "UNKNOWN",
                                   "INVALID_ARGUMENT",
                                   "DEADLINE_EXCEEDED",
                                   "NOT_FOUND",
                                   "ALREADY_EXISTS",
                                   "PERMISSION_DENIED",
                                   "RESOURCE_EXHAUSTED",
                                   "FAILED_PRECONDITION",
                                   "ABORTED",
                                   "OUT_OF_RANGE",
                                   "UNIMPLEMENTED",
                                   "INTERNAL",
                                   "UNAVAILABLE",
                                   "DATA_LOSS",
                                   "UNAUTHENTICATED"};
    const int i = int(c);
    return i >= 0 && i < 17 ? kNames[i] : std::to_string(i);
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, int64_t> counts_;
  std::vector<std::string> unexpected_;
  int64_t unexpected_total_ = 0;
};

grpc::StatusCode Code(const absl::Status& s) { return static_cast<grpc::StatusCode>(s.code()); }

struct Shared {
  explicit Shared(const Flags& f) : flags(f) {}
  const Flags& flags;
  std::vector<std::string> modules;  // Linear (delayed scaling), LayerNormMLP (current)
  std::vector<int64_t> in_features;
  Tally tally;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> abandoned{0}, ambiguous{0}, steps{0};
  // Abandoned contexts and when, for the release after --release-abandoned-after.
  std::mutex abandoned_mu;
  std::deque<std::pair<Clock::time_point, std::string>> abandoned_ids;
};

void RecordAbsl(Shared& sh, const char* op, const absl::Status& s) {
  sh.tally.Add(op, Code(s), s.ok(), std::string(s.message()));
}

// One client's loop. Every client has its own channel, as separate trainer processes would.
void RunClient(Shared& sh, int index) {
  const Flags& f = sh.flags;
  std::mt19937 rng(f.seed * 1000003u + uint32_t(index) + 1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  gradwire::client::ClientOptions options;
  options.server = f.server;
  options.timeout = std::chrono::seconds(60);
  Client c(options);
  if (!c.WaitForReady(std::chrono::seconds(10)).ok()) {
    sh.tally.Add("connect", grpc::StatusCode::UNAVAILABLE, false, "client could not connect");
    return;
  }
  while (!sh.stop.load()) {
    const size_t m = rng() % sh.modules.size();
    const std::string& module = sh.modules[m];
    const int64_t rows = 1 + int64_t(rng() % uint32_t(f.rows));
    const HostTensor input = Random(rng, {rows, sh.in_features[m]});
    double r = u(rng);
    if ((r -= f.weight_updates) < 0) {
      // A full upload of fresh weights: Linear [out, in] + bias, for the Linear module only
      // (the others keep their trained weights).
      auto w = c.GetWeights(sh.modules[0]);
      RecordAbsl(sh, "GetWeights", w.status());
      if (!w.ok()) continue;
      std::vector<std::pair<std::string, HostTensor>> params;
      for (const auto& [name, t] : w->tensors) {
        HostTensor fresh = Random(rng, t.shape);
        for (float& v : fresh.data) v *= 0.05f;
        params.emplace_back(name, std::move(fresh));
      }
      RecordAbsl(sh, "SetWeights", c.SetWeights(sh.modules[0], params).status());
    } else if ((r -= f.optimizer_steps) < 0) {
      RecordAbsl(sh, "ApplyGradients", c.ApplyGradients(module, 1e-4f).status());
    } else if ((r -= f.inference) < 0) {
      RecordAbsl(sh, "Forward(inference)", c.Forward(module, input, false).status());
    } else if ((r -= f.cancel) < 0) {
      // A training forward cut short: a deadline of a few ms, or an explicit cancel from another
      // thread. Either outcome is fine; a completed one is backwarded as usual.
      v1::ForwardRequest req;
      req.set_module_id(module);
      req.set_training(true);
      req.set_context_id(gradwire::client::NewContextId());
      *req.mutable_input() = gradwire::client::ToWire(input, gradwire::client::WireDType::kF32);
      v1::ForwardResponse resp;
      grpc::ClientContext ctx;
      c.PrepareContext(&ctx);
      const auto delay = std::chrono::microseconds(200 + rng() % 5000);
      std::thread canceller;
      const bool explicit_cancel = rng() % 2 == 0;
      if (explicit_cancel) {
        canceller = std::thread([&ctx, delay] {
          std::this_thread::sleep_for(delay);
          ctx.TryCancel();
        });
      } else {
        ctx.set_deadline(std::chrono::system_clock::now() + delay);
      }
      const grpc::Status s = c.stub().Forward(&ctx, req, &resp);
      if (canceller.joinable()) canceller.join();
      const bool allowed = s.ok() || s.error_code() == grpc::StatusCode::CANCELLED ||
                           s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
      sh.tally.Add(explicit_cancel ? "Forward(cancelled)" : "Forward(deadline)", s.error_code(),
                   allowed, s.error_message());
      if (s.ok()) {
        auto g = c.Backward(resp.context_id(), Random(rng, {rows, f.out_features}));
        RecordAbsl(sh, "Backward", g.status());
        if (!g.ok()) RecordAbsl(sh, "ReleaseContext", c.ReleaseContext(resp.context_id()));
      } else {
        // The outcome is unknown here: the server may have finished the forward and its answer
        // been lost to the cancel. The id was ours, so the context goes either way (NOT_FOUND:
        // the server had not made it, or released it itself on seeing the cancel).
        ++sh.ambiguous;
        const absl::Status released = c.ReleaseContext(req.context_id());
        sh.tally.Add("ReleaseContext(unanswered)", grpc::StatusCode(int(released.code())),
                     released.ok() || released.code() == absl::StatusCode::kNotFound,
                     std::string(released.message()));
      }
    } else {
      auto fwd = c.Forward(module, input, true);
      RecordAbsl(sh, "Forward(training)", fwd.status());
      if (!fwd.ok()) continue;
      if (u(rng) < f.abandon) {
        // Never backwarded, never released by this client: a trainer that went away.
        ++sh.abandoned;
        std::lock_guard<std::mutex> lock(sh.abandoned_mu);
        sh.abandoned_ids.emplace_back(Clock::now(), fwd->context_id);
        continue;
      }
      auto g = c.Backward(fwd->context_id, Random(rng, {rows, f.out_features}));
      RecordAbsl(sh, "Backward", g.status());
      // A failed backward keeps its context for a retry; this trainer gives up on it instead.
      if (!g.ok()) RecordAbsl(sh, "ReleaseContext", c.ReleaseContext(fwd->context_id));
      ++sh.steps;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"gradwire-soak: concurrent mixed load with leak and budget checks"};
  app.add_option("--server", f.server, "host:port of a running gradwire-server")->required();
  app.add_option("--server-pid", f.server_pid, "its process id, for the RSS check (0: skip)");
  app.add_option("--metrics", f.metrics, "host:port of its metrics endpoint (empty: none)");
  app.add_option("--clients", f.clients, "concurrent clients")->capture_default_str();
  app.add_option("--seconds", f.seconds, "duration of the run")->capture_default_str();
  app.add_option("--warmup-seconds", f.warmup_seconds,
                 "RSS baseline taken after this long (0: half of --seconds, 10 to 120 s)");
  app.add_option("--abandon", f.abandon, "fraction of training forwards never backwarded")
      ->capture_default_str();
  app.add_option("--cancel", f.cancel, "fraction of calls that are forwards cancelled mid-call")
      ->capture_default_str();
  app.add_option("--weight-updates", f.weight_updates, "fraction of calls that upload weights")
      ->capture_default_str();
  app.add_option("--optimizer-steps", f.optimizer_steps, "fraction of calls that step")
      ->capture_default_str();
  app.add_option("--inference", f.inference, "fraction of calls that are inference forwards")
      ->capture_default_str();
  app.add_option("--rss-growth", f.rss_growth, "largest allowed RSS growth after the warm-up")
      ->capture_default_str();
  app.add_option("--release-abandoned-after", f.release_abandoned_after,
                 "release abandoned contexts after this many seconds, standing in for the "
                 "server's eviction until it has one (0: never)")
      ->capture_default_str();
  app.add_option("--bytes-metric", f.bytes_metric,
                 "metric (name{labels}) of the live context bytes the budget bounds")
      ->capture_default_str();
  app.add_option("--held-metrics", f.held_metrics,
                 "metrics whose sum is the memory live contexts hold, for the RSS check")
      ->capture_default_str();
  app.add_option("--budget-metric", f.budget_metric,
                 "metric (name{labels}) of the context memory budget (skipped while the server "
                 "has none)")
      ->capture_default_str();
  app.add_option("--budget-bytes", f.budget_bytes,
                 "context budget in bytes (overrides the metric)");
  app.add_option("--in", f.in_features, "in_features of the modules")->capture_default_str();
  app.add_option("--out", f.out_features, "out_features of the modules")->capture_default_str();
  app.add_option("--rows", f.rows, "largest batch (rows per forward)")->capture_default_str();
  app.add_option("--seed", f.seed, "random seed")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const double warmup =
      f.warmup_seconds > 0 ? f.warmup_seconds : std::clamp(f.seconds * 0.5, 10.0, 120.0);

  Shared sh(f);
  gradwire::client::ClientOptions options;
  options.server = f.server;
  Client admin(options);
  if (auto s = admin.WaitForReady(std::chrono::seconds(10)); !s.ok()) {
    std::fprintf(stderr, "soak: cannot reach %s: %s\n", f.server.c_str(), s.ToString().c_str());
    return 1;
  }
  v1::ModuleSpec spec;
  spec.set_in_features(f.in_features);
  spec.set_out_features(f.out_features);
  spec.set_seed(f.seed + 1);
  spec.set_kind(v1::LINEAR);
  spec.mutable_recipe()->set_scaling(v1::DELAYED);
  spec.mutable_optimizer()->mutable_sgd()->set_learning_rate(1e-4f);
  spec.set_max_staleness(-1);  // weights change under the contexts all the time
  auto lin = admin.CreateModule(spec);
  spec.set_kind(v1::LAYERNORM_MLP);
  spec.set_ffn_features(f.ffn_features);
  spec.mutable_recipe()->set_scaling(v1::CURRENT);
  auto mlp = admin.CreateModule(spec);
  if (!lin.ok() || !mlp.ok()) {
    std::fprintf(stderr, "soak: cannot create modules: %s %s\n", lin.status().ToString().c_str(),
                 mlp.status().ToString().c_str());
    return 1;
  }
  sh.modules = {lin->module_id(), mlp->module_id()};
  sh.in_features = {f.in_features, f.in_features};
  auto info0 = admin.GetServerInfo();
  const int64_t live_before = info0.ok() ? info0->live_contexts() : 0;

  // The poller: context bytes against the budget, RSS, every 200 ms.
  std::optional<httplib::Client> http;
  if (!f.metrics.empty()) http.emplace("http://" + f.metrics);
  int64_t budget = f.budget_bytes;
  bool budget_from_metric = false;
  int64_t max_bytes = 0, max_live = 0, over_budget = 0, polls = 0;
  int64_t rss_warm = -1, rss_peak = 0, held_at_warm = 0;
  int64_t held = -1;  // the last poll's sum of --held-metrics (-1: not known)
  auto poll = [&] {
    int64_t bytes = -1;
    held = -1;
    if (http) {
      if (auto res = http->Get("/metrics"); res && res->status == 200) {
        if (auto b = MetricValue(res->body, f.bytes_metric)) bytes = int64_t(*b);
        int64_t sum = 0;
        bool all = true;
        for (const std::string& m : f.held_metrics) {
          auto v = MetricValue(res->body, m);
          all = all && v.has_value();
          if (v) sum += int64_t(*v);
        }
        if (all) held = sum;
        if (f.budget_bytes == 0) {
          if (auto b = MetricValue(res->body, f.budget_metric); b && *b > 0) {
            budget = int64_t(*b);
            budget_from_metric = true;
          }
        }
      }
    }
    if (auto info = admin.GetServerInfo(); info.ok()) {
      if (bytes < 0) bytes = info->context_bytes();
      if (held < 0) held = info->context_bytes();
      max_live = std::max(max_live, info->live_contexts());
    }
    ++polls;
    max_bytes = std::max(max_bytes, bytes);
    if (budget > 0 && bytes > budget) ++over_budget;
    if (f.server_pid > 0) rss_peak = std::max(rss_peak, RssKiB(f.server_pid));
    return bytes;
  };

  const auto start = Clock::now();
  std::vector<std::thread> clients;
  for (int i = 0; i < f.clients; ++i) clients.emplace_back(RunClient, std::ref(sh), i);
  bool warmed = false;
  int64_t released = 0;
  auto release_abandoned = [&] {
    const auto cutoff =
        Clock::now() - std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(f.release_abandoned_after));
    for (;;) {
      std::string id;
      {
        std::lock_guard<std::mutex> lock(sh.abandoned_mu);
        if (sh.abandoned_ids.empty() || sh.abandoned_ids.front().first > cutoff) break;
        id = std::move(sh.abandoned_ids.front().second);
        sh.abandoned_ids.pop_front();
      }
      const absl::Status s = admin.ReleaseContext(id);
      // NOT_FOUND once the server's own eviction got there first.
      sh.tally.Add("ReleaseContext(abandoned)", Code(s),
                   s.ok() || s.code() == absl::StatusCode::kNotFound, std::string(s.message()));
      ++released;
    }
  };
  auto last_progress = start;
  while (Clock::now() - start < std::chrono::duration<double>(f.seconds)) {
    if (f.release_abandoned_after > 0) release_abandoned();
    const int64_t bytes = poll();
    if (Clock::now() - last_progress >= std::chrono::seconds(10)) {
      last_progress = Clock::now();
      std::fprintf(stderr, "soak: %5.0f s: %lld steps, server RSS %lld KiB, context bytes %lld\n",
                   std::chrono::duration<double>(last_progress - start).count(),
                   (long long)sh.steps.load(),
                   (long long)(f.server_pid > 0 ? RssKiB(f.server_pid) : -1), (long long)bytes);
    }
    if (!warmed && Clock::now() - start >= std::chrono::duration<double>(warmup)) {
      warmed = true;
      if (f.server_pid > 0) rss_warm = RssKiB(f.server_pid);
      held_at_warm = std::max<int64_t>(held, 0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  sh.stop = true;
  for (std::thread& t : clients) t.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  // Let cancelled forwards still queued on the server finish and release their contexts.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int64_t bytes_end = std::max<int64_t>(poll(), 0);
  const int64_t held_end = std::max<int64_t>(held, 0);
  auto info = admin.GetServerInfo();
  const int64_t live_end = info.ok() ? info->live_contexts() - live_before : -1;
  const int64_t rss_end = f.server_pid > 0 ? RssKiB(f.server_pid) : -1;

  int failures = 0;
  std::printf("soak: %d clients, %.0f s, %lld training steps (%.1f/s), %lld abandoned contexts\n",
              f.clients, elapsed, (long long)sh.steps.load(), double(sh.steps.load()) / elapsed,
              (long long)sh.abandoned.load());
  sh.tally.Print();
  if (sh.tally.unexpected() > 0) {
    std::printf("soak: FAIL %lld calls ended with an unexpected status\n",
                (long long)sh.tally.unexpected());
    ++failures;
  }
  std::printf("soak: context bytes max %lld, end %lld; live contexts max %lld, end %lld\n",
              (long long)max_bytes, (long long)bytes_end, (long long)max_live, (long long)live_end);
  if (budget > 0) {
    std::printf("soak: context budget %lld bytes (%s): exceeded in %lld of %lld polls\n",
                (long long)budget, budget_from_metric ? f.budget_metric.c_str() : "--budget-bytes",
                (long long)over_budget, (long long)polls);
    if (over_budget > 0) ++failures;
  } else {
    std::printf("soak: no context budget (metric %s absent, no --budget-bytes): check skipped\n",
                f.budget_metric.c_str());
  }
  // Without a budget nothing evicts, so every abandoned context is still live; with one, fewer
  // may be. A cancelled forward may have finished on the server as the client gave up.
  const int64_t kept = sh.abandoned.load() - released;
  const int64_t allowed_live = kept;
  std::printf("soak: %lld abandoned contexts released by the soak after %.0f s, %lld still held\n",
              (long long)released, f.release_abandoned_after, (long long)kept);
  if (live_end < 0 || live_end > allowed_live || (budget == 0 && live_end < kept)) {
    std::printf(
        "soak: FAIL %lld contexts live at the end; %lld abandoned and held (%lld cancelled "
        "forwards released by their clients)\n",
        (long long)live_end, (long long)kept, (long long)sh.ambiguous.load());
    ++failures;
  }
  if (f.server_pid > 0) {
    // Live contexts are memory the server holds on purpose (their saved tensors bounded by the
    // budget, checked above, and the weight versions they keep); the RSS check is about
    // everything else.
    const int64_t held_kib = (held_end - held_at_warm) / 1024;
    const double limit = double(rss_warm) * (1.0 + f.rss_growth);
    std::printf(
        "soak: server RSS after warm-up %lld KiB, peak %lld KiB, end %lld KiB; memory held by "
        "live contexts grew %lld KiB since the warm-up; limit %.0f KiB + that\n",
        (long long)rss_warm, (long long)rss_peak, (long long)rss_end, (long long)held_kib, limit);
    if (rss_warm <= 0 || rss_end <= 0 || double(rss_end - std::max<int64_t>(held_kib, 0)) > limit) {
      std::printf("soak: FAIL server RSS grew more than %.0f%% after the warm-up\n",
                  f.rss_growth * 100);
      ++failures;
    }
  }
  std::printf("soak: %s\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}
