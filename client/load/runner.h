// Drives an operation under closed-loop concurrency or an open-loop arrival schedule and collects
// per-request timings. Open-loop latency is measured from each request's intended send time, so a
// stalled server shows in the latencies of every request that should have gone out meanwhile (no
// coordinated omission).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace gradwire::load {

// What one request did. Stage times are the op's own measurements (forward, backward); -1: none.
struct OpOutcome {
  std::string code = "OK";  // gRPC status code name
  std::array<double, 2> stage_seconds{-1, -1};
  double server_seconds = 0;  // the server's own compute time, where it reports one
  int64_t bytes = 0;          // payload bytes sent and received
  int batch_requests = 0;     // a forward the server batched: the requests in its batch (0: alone)
};

// `worker` is 0..workers-1: ops may keep per-worker state.
using Op = std::function<OpOutcome(int worker)>;

struct RunConfig {
  int concurrency = 1;     // closed loop: workers issuing back to back; open loop: max in flight
  double rate = 0;         // > 0: open loop, this many requests per second
  bool poisson = false;    // open loop: exponential gaps instead of even spacing
  double duration_s = 10;  // measured time (after warm-up), unless count > 0
  int64_t count = 0;       // > 0: stop after this many measured requests
  double warmup_s = 1;     // requests started (intended) earlier are not measured
  uint64_t seed = 1;
};

struct RunResult {
  double seconds = 0;  // the measured window
  int64_t requests = 0;
  int64_t ok = 0;
  std::map<std::string, int64_t> codes;
  std::vector<double> latency;               // whole request
  std::array<std::vector<double>, 2> stage;  // per stage, OK requests that had it
  double server_seconds = 0;                 // sum over measured requests
  int64_t bytes = 0;
  double max_send_lag = 0;  // open loop: worst delay between intended and actual send
  // OK forwards by the size of the server's batch they ran in (1: alone).
  std::map<int64_t, int64_t> batch_sizes;
};

// `progress` (may be empty) is called about twice a second with the fraction done.
RunResult Run(const RunConfig& config, const Op& op,
              const std::function<void(double fraction, int64_t done)>& progress);

}  // namespace gradwire::load
