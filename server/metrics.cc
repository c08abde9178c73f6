#include "server/metrics.h"

#include <prometheus/text_serializer.h>

#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "server/device/gemm_counters.h"

namespace gradwire::server {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// A label value that comes from a client (module names may be 256 bytes): its first 64 bytes.
// The server hands out only printable ASCII here (rpc/boundary.h), so a cut splits no character.
std::string Label(const std::string& s) {
  constexpr size_t kMax = 64;
  return s.size() <= kMax ? s : s.substr(0, kMax) + "...";
}

MetricFamily Family(const char* name, MetricType type, const char* help) {
  MetricFamily f;
  f.name = name;
  f.type = type;
  f.help = help;
  return f;
}

ClientMetric Sample(double value, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;  // the serializer reads the field of the family's type
  m.counter.value = value;
  return m;
}

MetricFamily Single(const char* name, MetricType type, const char* help, double value) {
  MetricFamily f = Family(name, type, help);
  f.metric.push_back(Sample(value));
  return f;
}

// A gauge with a device and a host sample (label memory).
MetricFamily ByMemory(const char* name, const char* help, int64_t device, int64_t host) {
  MetricFamily f = Family(name, MetricType::Gauge, help);
  f.metric.push_back(Sample(double(device), {{"memory", "device"}}));
  f.metric.push_back(Sample(double(host), {{"memory", "host"}}));
  return f;
}

}  // namespace

const std::vector<double>& Metrics::LatencyBuckets() {
  static const std::vector<double> buckets = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                              0.1,    0.25,  0.5,    1.0,   2.5,  5.0,   10.0};
  return buckets;
}

const std::vector<double>& Metrics::QueueWaitBuckets() {
  static const std::vector<double> buckets = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                                              0.005,   0.01,   0.025,   0.05,   0.1,   0.25,
                                              0.5,     1.0,    2.5,     5.0,    10.0};
  return buckets;
}

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      calls_(prometheus::BuildCounter()
                 .Name("gradwire_rpc_total")
                 .Help("RPCs finished, by method and status code.")
                 .Register(*registry_)),
      latency_(prometheus::BuildHistogram()
                   .Name("gradwire_rpc_duration_seconds")
                   .Help("Time from a call's arrival to its status, by method.")
                   .Register(*registry_)),
      client_latency_(prometheus::BuildHistogram()
                          .Name("gradwire_client_rpc_duration_seconds")
                          .Help("Time from a call's arrival to its status, by client (its tenant "
                                "with tokens, else its peer host) and method.")
                          .Register(*registry_)),
      queue_wait_(prometheus::BuildHistogram()
                      .Name("gradwire_queue_wait_seconds")
                      .Help("Time a call's work waited for the device executor (the control "
                            "thread for CreateModule and DeleteModule), by method; each Train "
                            "message counts once.")
                      .Register(*registry_)),
      client_queue_wait_(prometheus::BuildHistogram()
                             .Name("gradwire_client_queue_wait_seconds")
                             .Help("Time a call's work waited for the device executor, by client "
                                   "(its tenant with tokens, else its peer host): what the fair "
                                   "queuing between clients gives each.")
                             .Register(*registry_)),
      batch_requests_(prometheus::BuildHistogram()
                          .Name("gradwire_batch_requests")
                          .Help("Requests per batch of the dynamic batcher (--max-batch-rows): "
                                "forwards of one module, or backwards of its contexts, run as "
                                "one backend call; by method.")
                          .Register(*registry_)),
      batch_rows_(prometheus::BuildHistogram()
                      .Name("gradwire_batch_rows")
                      .Help("Rows per batch of the dynamic batcher, all its requests together.")
                      .Register(*registry_)),
      build_info_(prometheus::BuildGauge()
                      .Name("gradwire_build_info")
                      .Help("1, labelled with the server's version and device.")
                      .Register(*registry_)) {
  // Its change is how a restart shows (deploy/observability: GradwireRestarted).
  prometheus::BuildGauge()
      .Name("gradwire_start_time_seconds")
      .Help("When this server process started, seconds since the Unix epoch.")
      .Register(*registry_)
      .Add({})
      .Set(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
               .count());
}

template <typename T, typename... Args>
T& Metrics::Series(prometheus::Family<T>& family, const prometheus::Labels& labels,
                   Args&&... args) {
  std::lock_guard<std::mutex> lock(series_mu_);
  void*& series = series_[{&family, labels}];
  if (series == nullptr) series = &family.Add(labels, std::forward<Args>(args)...);
  return *static_cast<T*>(series);
}

void Metrics::ObserveRpc(const rpc::RpcRecord& r) {
  Series(calls_, {{"method", r.method}, {"code", absl::StatusCodeToString(r.code)}}).Increment();
  Series(latency_, {{"method", r.method}}, LatencyBuckets()).Observe(r.seconds);
  if (!r.client.empty()) {
    Series(client_latency_, {{"client", Label(r.client)}, {"method", r.method}}, LatencyBuckets())
        .Observe(r.seconds);
  }
}

void Metrics::ObserveQueueWait(const char* method, const std::string& client, double seconds) {
  Series(queue_wait_, {{"method", method}}, QueueWaitBuckets()).Observe(seconds);
  if (!client.empty()) {
    Series(client_queue_wait_, {{"client", Label(client)}}, QueueWaitBuckets()).Observe(seconds);
  }
}

void Metrics::ObserveBatch(const char* method, int64_t requests, int64_t rows) {
  static const std::vector<double> request_buckets = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  static const std::vector<double> row_buckets = {1,   2,   4,   8,    16,   32,   64,
                                                  128, 256, 512, 1024, 2048, 4096, 8192};
  Series(batch_requests_, {{"method", method}}, request_buckets).Observe(double(requests));
  Series(batch_rows_, {{"method", method}}, row_buckets).Observe(double(rows));
}

void Metrics::SetBuildInfo(const std::string& version, const std::string& device) {
  build_info_.Add({{"version", version}, {"device", device}}).Set(1);
}

std::vector<MetricFamily> Metrics::State(const core::ModuleHost& host, int64_t executor_queued,
                                         const std::vector<rpc::ClientUsage>& usage) {
  constexpr MetricType kGauge = MetricType::Gauge, kCounter = MetricType::Counter;
  std::vector<MetricFamily> out;
  const core::HostStats stats = host.Stats();
  out.push_back(Single("gradwire_modules", kGauge, "Modules hosted.", double(stats.modules)));
  out.push_back(Single("gradwire_live_contexts", kGauge,
                       "Training contexts waiting for a backward.", double(stats.live_contexts)));
  if (executor_queued >= 0) {
    out.push_back(Single("gradwire_executor_queued_tasks", kGauge,
                         "Work accepted and waiting for the device executor, not yet started.",
                         double(executor_queued)));
  }
  const core::ContextStats& c = stats.contexts;
  out.push_back(Single("gradwire_offloaded_contexts", kGauge,
                       "Live contexts whose saved tensors are offloaded to host memory.",
                       double(c.offloaded)));
  out.push_back(
      ByMemory("gradwire_context_bytes",
               "Bytes of saved tensors held by live contexts, on the device and offloaded to host.",
               c.device_bytes, c.host_bytes));
  out.push_back(Single("gradwire_pinned_weight_bytes", kGauge,
                       "FP8 weights of the weight versions live contexts keep for their backward, "
                       "each version counted once (not part of the context budgets).",
                       double(c.weight_bytes)));
  out.push_back(Single("gradwire_pinned_weight_bytes_peak", kGauge,
                       "Most bytes of pinned weight versions held at once since start.",
                       double(c.peak_weight_bytes)));
  const core::ContextLimits& limits = host.contexts().limits();
  out.push_back(ByMemory(
      "gradwire_context_budget_bytes",
      "Budgets of saved-tensor bytes: --context-memory (device) and --host-offload-memory.",
      limits.device_bytes, limits.host_bytes));
  out.push_back(
      Single("gradwire_pinned_weight_versions", kGauge,
             "Weight versions held by live contexts (the current one too while a context uses it).",
             double(c.pinned_weights)));
  out.push_back(ByMemory("gradwire_context_bytes_peak",
                         "Most bytes of saved tensors held at once since start (never above the "
                         "budget).",
                         c.peak_device_bytes, c.peak_host_bytes));
  out.push_back(Single("gradwire_context_offloads_total", kCounter,
                       "Contexts moved to host memory to keep the device budget.",
                       double(c.offloads)));
  out.push_back(Single("gradwire_context_restores_total", kCounter,
                       "Offloaded contexts brought back to the device for their backward.",
                       double(c.restores)));
  MetricFamily evictions = Family("gradwire_context_evictions_total", kCounter,
                                  "Contexts evicted before their backward, by reason.");
  evictions.metric.push_back(Sample(double(c.evicted_ttl), {{"reason", "ttl"}}));
  evictions.metric.push_back(Sample(double(c.evicted_memory), {{"reason", "memory"}}));
  out.push_back(std::move(evictions));
  out.push_back(
      Single("gradwire_context_rejections_total", kCounter,
             "Training forwards refused because their context alone exceeded the device budget.",
             double(c.rejected_too_large)));
  out.push_back(Single("gradwire_modules_expired_total", kCounter,
                       "Modules released because no call or keep-alive touched them for "
                       "--module-ttl seconds.",
                       double(stats.modules_expired)));
  out.push_back(Single("gradwire_workspace_builds_total", kCounter,
                       "FP8 weight casts: weight-workspace cache misses.",
                       double(stats.workspace_builds)));
  out.push_back(Single("gradwire_workspace_hits_total", kCounter, "Weight-workspace cache hits.",
                       double(stats.workspace_hits)));
  const device::GemmCounters gemm = device::GemmTotals();
  out.push_back(Single("gradwire_gemm_flops_total", kCounter,
                       "Floating-point operations of FP8 GEMMs.", gemm.flops));
  out.push_back(Single("gradwire_gemm_seconds_total", kCounter,
                       "Time spent in FP8 GEMMs (achieved FLOP/s = rate(flops) / rate(seconds)).",
                       gemm.seconds));
  out.push_back(Single("gradwire_context_quota_rejections_total", kCounter,
                       "Training forwards refused by --max-context-bytes-per-client.",
                       double(c.rejected_quota)));
  out.push_back(Single("gradwire_context_share_rejections_total", kCounter,
                       "Training forwards refused because their tenant was over its fair share of "
                       "full context memory.",
                       double(c.rejected_share)));

  struct Gauge {
    const char* name;
    const char* help;
    int64_t rpc::ClientUsage::*field;
  };
  static constexpr Gauge kUsage[] = {
      {"gradwire_client_parameter_bytes",
       "fp32 parameter bytes of each client's modules (quota --max-parameter-bytes-per-client).",
       &rpc::ClientUsage::parameter_bytes},
      {"gradwire_client_context_bytes",
       "Saved-tensor bytes of each client's live contexts, device and host (quota "
       "--max-context-bytes-per-client).",
       &rpc::ClientUsage::context_bytes},
      {"gradwire_client_stream_bytes",
       "Chunked request bytes each client has in flight (quota --max-stream-bytes-per-client).",
       &rpc::ClientUsage::stream_bytes},
      {"gradwire_client_queued_calls",
       "Calls of each client waiting for the device (limit --max-queued-per-client).",
       &rpc::ClientUsage::queued},
  };
  for (const Gauge& g : kUsage) {
    MetricFamily f = Family(g.name, kGauge, g.help);
    for (const rpc::ClientUsage& u : usage) {
      f.metric.push_back(Sample(double(u.*g.field), {{"client", Label(u.client)}}));
    }
    out.push_back(std::move(f));
  }

  MetricFamily version =
      Family("gradwire_module_weight_version", kGauge, "Weight version of each module.");
  MetricFamily scale = Family(
      "gradwire_fp8_scale", kGauge,
      "Scale the next cast of each tensor role uses (delayed scaling), 1 under current scaling.");
  MetricFamily amax =
      Family("gradwire_fp8_amax", kGauge, "Amax of the last step's cast of each tensor role.");
  for (const core::ModuleInfo& m : host.List()) {
    const std::vector<ClientMetric::Label> labels = {{"module", Label(m.module_id)},
                                                     {"name", Label(m.spec.name)}};
    version.metric.push_back(Sample(double(m.weight_version), labels));
    auto roles = host.Scaling(m.module_id);
    if (!roles.ok()) continue;  // deleted meanwhile
    for (const core::RoleScaling& r : *roles) {
      std::vector<ClientMetric::Label> role = labels;
      role.push_back({"role", r.role});
      scale.metric.push_back(Sample(r.scale, role));
      if (!r.history.empty()) amax.metric.push_back(Sample(r.history.front(), std::move(role)));
    }
  }
  out.push_back(std::move(version));
  out.push_back(std::move(scale));
  out.push_back(std::move(amax));
  return out;
}

std::string Metrics::Render(const core::ModuleHost& host, int64_t executor_queued,
                            const std::vector<rpc::ClientUsage>& usage) const {
  std::vector<MetricFamily> all = registry_->Collect();
  for (MetricFamily& f : State(host, executor_queued, usage)) all.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(all);
}

}  // namespace gradwire::server
