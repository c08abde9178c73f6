// Prometheus metrics of gradwire-server, through prometheus-cpp: RPC counts by method and status,
// latency histograms by method and by client, time in the executor's queue, live contexts and
// their bytes, workspace-cache hits and misses, per-module weight versions and FP8 scaling state,
// GEMM work, and the process's start time and build.
//
// Two kinds of metric, one exposition: what calls add up (counters and histograms) lives in a
// prometheus-cpp Registry and is updated as calls finish; what the server holds now (contexts,
// modules, quotas, GEMM totals) is read at each scrape (State), so a scrape sees one consistent
// reading of the host instead of gauges updated from many places.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "server/core/module_host.h"
#include "server/rpc/service.h"
#include "server/rpc/usage.h"

namespace gradwire::server {

class Metrics {
 public:
  // Upper bounds (seconds) of the latency histograms' buckets; +Inf is implied.
  static const std::vector<double>& LatencyBuckets();
  // Upper bounds (seconds) of the queue-wait histogram's buckets: a wait is often well under a
  // millisecond, so they start lower.
  static const std::vector<double>& QueueWaitBuckets();

  Metrics();

  // One finished RPC: counted by method and code; its time from arrival to status observed by
  // method, and by client and method when it has a client (authentication passed).
  void ObserveRpc(const rpc::RpcRecord& r);
  // How long a call's work (or one Train message) waited for the executor before it started: by
  // method, and by client when it has one.
  void ObserveQueueWait(const char* method, const std::string& client, double seconds);
  // One batch of the dynamic batcher: how many requests and rows ran in one backend call.
  void ObserveBatch(const char* method, int64_t requests, int64_t rows);
  // gradwire_build_info{version, device}: set once the server knows its backend.
  void SetBuildInfo(const std::string& version, const std::string& device);

  // What the server holds now, read when called: the host's state, the device executor's backlog
  // when `executor_queued` >= 0, and each client's use of its quotas.
  static std::vector<prometheus::MetricFamily> State(
      const core::ModuleHost& host, int64_t executor_queued = -1,
      const std::vector<rpc::ClientUsage>& usage = {});

  // The whole exposition in the Prometheus text format (prometheus-cpp's serializer): the
  // registry's counters and histograms, then State(). What a scrape of /metrics gets.
  std::string Render(const core::ModuleHost& host, int64_t executor_queued = -1,
                     const std::vector<rpc::ClientUsage>& usage = {}) const;

 private:
  // The series of `family` with `labels`, made on first use. prometheus-cpp's Family::Add builds
  // a fresh metric (a histogram's buckets) on every call before it finds the existing one, so
  // the hot path looks its series up here instead.
  template <typename T, typename... Args>
  T& Series(prometheus::Family<T>& family, const prometheus::Labels& labels, Args&&... args);

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& calls_;
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Family<prometheus::Histogram>& client_latency_;
  prometheus::Family<prometheus::Histogram>& queue_wait_;
  prometheus::Family<prometheus::Histogram>& client_queue_wait_;
  prometheus::Family<prometheus::Histogram>& batch_requests_;
  prometheus::Family<prometheus::Histogram>& batch_rows_;
  prometheus::Family<prometheus::Gauge>& build_info_;
  std::mutex series_mu_;
  std::map<std::pair<const void*, prometheus::Labels>, void*> series_;  // guarded by series_mu_
};

}  // namespace gradwire::server
