// Prometheus metrics of gradwire-server: RPC counts and latency histograms by method and status,
// live contexts and their bytes, workspace-cache hits and misses, per-module weight versions and
// FP8 scaling state, and GEMM work. Rendered in the Prometheus text format (version 0.0.4).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "server/core/module_host.h"
#include "server/rpc/usage.h"

namespace gradwire::server {

class Metrics {
 public:
  // Upper bounds (seconds) of the latency histogram buckets; +Inf is implied.
  static constexpr std::array<double, 14> kBuckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};

  // One finished RPC.
  void ObserveRpc(const std::string& method, absl::StatusCode code, double seconds);

  // The whole exposition: RPC metrics plus the host's state as it is now, and the device
  // executor's backlog when `executor_queued` >= 0, and each client's use of its quotas.
  std::string Render(const core::ModuleHost& host, int64_t executor_queued = -1,
                     const std::vector<rpc::ClientUsage>& usage = {}) const;

 private:
  struct Histogram {
    std::array<int64_t, kBuckets.size()> buckets{};  // non-cumulative counts per bucket
    int64_t count = 0;
    double sum = 0;
  };
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, int64_t> calls_;  // (method, code) -> count
  std::map<std::string, Histogram> latency_;                      // method -> histogram
};

}  // namespace gradwire::server
