#include "server/metrics.h"

#include <cmath>
#include <sstream>

#include "server/core/fp8_ops.h"

namespace gradwire::server {
namespace {

// Label values escape backslash, quote and newline.
std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// A label value from a client: at most 64 bytes of it (names may be up to 256), escaped.
std::string Label(const std::string& s) {
  constexpr size_t kMax = 64;
  return s.size() <= kMax ? Escape(s) : Escape(s.substr(0, kMax)) + "...";
}

std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

void Header(std::ostringstream& out, const char* name, const char* type, const char* help) {
  out << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
}

// A gauge with a device and a host sample (label memory).
void ByMemory(std::ostringstream& out, const char* name, const char* help, int64_t device,
              int64_t host) {
  Header(out, name, "gauge", help);
  out << name << "{memory=\"device\"} " << device << '\n';
  out << name << "{memory=\"host\"} " << host << '\n';
}

// A metric with one unlabelled sample.
template <typename V>
void Single(std::ostringstream& out, const char* name, const char* type, const char* help,
            const V& value) {
  Header(out, name, type, help);
  out << name << ' ' << value << '\n';
}

}  // namespace

void Metrics::ObserveRpc(const std::string& method, absl::StatusCode code, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ++calls_[{method, absl::StatusCodeToString(code)}];
  Histogram& h = latency_[method];
  size_t b = 0;
  while (b < kBuckets.size() && seconds > kBuckets[b]) ++b;
  if (b < kBuckets.size()) ++h.buckets[b];
  ++h.count;
  h.sum += seconds;
}

std::string Metrics::Render(const core::ModuleHost& host, int64_t executor_queued,
                            const std::vector<rpc::ClientUsage>& usage) const {
  std::ostringstream out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Header(out, "gradwire_rpc_total", "counter", "RPCs finished, by method and status code.");
    for (const auto& [key, n] : calls_) {
      out << "gradwire_rpc_total{method=\"" << Escape(key.first) << "\",code=\""
          << Escape(key.second) << "\"} " << n << '\n';
    }
    Header(out, "gradwire_rpc_duration_seconds", "histogram",
           "Time from a call's arrival to its status, by method.");
    for (const auto& [method, h] : latency_) {
      int64_t cumulative = 0;
      for (size_t b = 0; b < kBuckets.size(); ++b) {
        cumulative += h.buckets[b];
        out << "gradwire_rpc_duration_seconds_bucket{method=\"" << Escape(method) << "\",le=\""
            << Number(kBuckets[b]) << "\"} " << cumulative << '\n';
      }
      out << "gradwire_rpc_duration_seconds_bucket{method=\"" << Escape(method)
          << "\",le=\"+Inf\"} " << h.count << '\n';
      out << "gradwire_rpc_duration_seconds_sum{method=\"" << Escape(method) << "\"} "
          << Number(h.sum) << '\n';
      out << "gradwire_rpc_duration_seconds_count{method=\"" << Escape(method) << "\"} " << h.count
          << '\n';
    }
  }
  const core::HostStats stats = host.Stats();
  Single(out, "gradwire_modules", "gauge", "Modules hosted.", stats.modules);
  Single(out, "gradwire_live_contexts", "gauge", "Training contexts waiting for a backward.",
         stats.live_contexts);
  if (executor_queued >= 0) {
    Single(out, "gradwire_executor_queued_tasks", "gauge",
           "Work accepted and waiting for the device executor, not yet started.", executor_queued);
  }
  const core::ContextStats& c = stats.contexts;
  Single(out, "gradwire_offloaded_contexts", "gauge",
         "Live contexts whose saved tensors are offloaded to host memory.", c.offloaded);
  ByMemory(out, "gradwire_context_bytes",
           "Bytes of saved tensors held by live contexts, on the device and offloaded to host.",
           c.device_bytes, c.host_bytes);
  Single(out, "gradwire_pinned_weight_bytes", "gauge",
         "FP8 weights of the weight versions live contexts keep for their backward, each version "
         "counted once (not part of the context budgets).",
         c.weight_bytes);
  Single(out, "gradwire_pinned_weight_bytes_peak", "gauge",
         "Most bytes of pinned weight versions held at once since start.", c.peak_weight_bytes);
  const core::ContextLimits& limits = host.contexts().limits();
  ByMemory(out, "gradwire_context_budget_bytes",
           "Budgets of saved-tensor bytes: --context-memory (device) and --host-offload-memory.",
           limits.device_bytes, limits.host_bytes);
  Single(out, "gradwire_pinned_weight_versions", "gauge",
         "Weight versions held by live contexts (the current one too while a context uses it).",
         c.pinned_weights);
  ByMemory(out, "gradwire_context_bytes_peak",
           "Most bytes of saved tensors held at once since start (never above the budget).",
           c.peak_device_bytes, c.peak_host_bytes);
  Single(out, "gradwire_context_offloads_total", "counter",
         "Contexts moved to host memory to keep the device budget.", c.offloads);
  Single(out, "gradwire_context_restores_total", "counter",
         "Offloaded contexts brought back to the device for their backward.", c.restores);
  Header(out, "gradwire_context_evictions_total", "counter",
         "Contexts evicted before their backward, by reason.");
  out << "gradwire_context_evictions_total{reason=\"ttl\"} " << c.evicted_ttl << '\n';
  out << "gradwire_context_evictions_total{reason=\"memory\"} " << c.evicted_memory << '\n';
  Single(out, "gradwire_context_rejections_total", "counter",
         "Training forwards refused because their context alone exceeded the device budget.",
         c.rejected_too_large);
  Single(out, "gradwire_workspace_builds_total", "counter",
         "FP8 weight casts: weight-workspace cache misses.", stats.workspace_builds);
  Single(out, "gradwire_workspace_hits_total", "counter", "Weight-workspace cache hits.",
         stats.workspace_hits);
  const core::GemmCounters gemm = core::GemmTotals();
  Single(out, "gradwire_gemm_flops_total", "counter", "Floating-point operations of FP8 GEMMs.",
         Number(gemm.flops));
  Single(out, "gradwire_gemm_seconds_total", "counter",
         "Time spent in FP8 GEMMs (achieved FLOP/s = rate(flops) / rate(seconds)).",
         Number(gemm.seconds));

  Single(out, "gradwire_context_quota_rejections_total", "counter",
         "Training forwards refused by --max-context-bytes-per-client.", c.rejected_quota);
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
    Header(out, g.name, "gauge", g.help);
    for (const rpc::ClientUsage& u : usage) {
      out << g.name << "{client=\"" << Label(u.client) << "\"} " << u.*g.field << '\n';
    }
  }

  Header(out, "gradwire_module_weight_version", "gauge", "Weight version of each module.");
  std::ostringstream scale, amax;
  for (const core::ModuleInfo& m : host.List()) {
    const std::string labels =
        "module=\"" + Label(m.module_id) + "\",name=\"" + Label(m.spec.name) + "\"";
    out << "gradwire_module_weight_version{" << labels << "} " << m.weight_version << '\n';
    auto roles = host.Scaling(m.module_id);
    if (!roles.ok()) continue;  // deleted meanwhile
    for (const core::RoleScaling& r : *roles) {
      const std::string role = labels + ",role=\"" + Escape(r.role) + "\"";
      scale << "gradwire_fp8_scale{" << role << "} " << Number(r.scale) << '\n';
      if (!r.history.empty()) {
        amax << "gradwire_fp8_amax{" << role << "} " << Number(r.history.front()) << '\n';
      }
    }
  }
  Header(
      out, "gradwire_fp8_scale", "gauge",
      "Scale the next cast of each tensor role uses (delayed scaling), 1 under current scaling.");
  out << scale.str();
  Header(out, "gradwire_fp8_amax", "gauge", "Amax of the last step's cast of each tensor role.");
  out << amax.str();
  return out.str();
}

}  // namespace gradwire::server
