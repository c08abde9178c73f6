// gradwire-load: drives a gradwire server with forwards or training steps and reports latency
// percentiles, throughput and status codes, next to an in-process run of the same module and an
// empty-RPC run on the same server.
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gradwire/client/client.h"
#include "gradwire/client/kinds.h"
#include "gradwire/client/recipes.h"
#include "gradwire/client/shared_memory.h"
#include "gradwire/kernels/random.h"
#include "inprocess.h"
#include "progress.h"
#include "runner.h"
#include "stats.h"

namespace {

using gradwire::client::Client;
using gradwire::client::ClientOptions;
using gradwire::client::HostTensor;
using gradwire::load::OpOutcome;
using gradwire::load::RunConfig;
using gradwire::load::RunResult;
namespace v1 = gradwire::v1;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string flow = "forward";  // forward | step | empty | stream
  std::string module_id;         // an existing module; else one is created from the spec below
  int modules = 1;               // modules created (workers spread over them), without module_id
  std::string kind = "linear";   // linear | layernorm-linear | layernorm-mlp
  int64_t in_features = 1024, out_features = 1024, ffn_features = 4096;
  bool bias = true;
  std::string recipe;  // empty: the server's --default-recipe
  int64_t rows = 1;
  std::string wire = "exact";
  RunConfig run;
  std::string arrivals = "constant";
  std::vector<int> sweep;
  bool baselines = false;
  std::string baseline_device = "cpu";
  std::string json_path, csv_path, plot_path;
  bool keep_module = false;
  int rounds = 1;  // repeat remote / in-process / empty interleaved, merging each mode's samples
  // auto: tensors through shared memory when the server on this host gives this process regions
  // and a worker's tensors reach 64 KiB; on: always (an error when it cannot); off: the wire.
  std::string shared_memory = "auto";
};

// A tensor's bytes, whether it carries them or references shared memory.
int64_t TensorBytes(const v1::Tensor& t) {
  return t.has_shared_memory() ? int64_t(t.shared_memory().byte_size()) : int64_t(t.data().size());
}

// Appends `b`'s samples and counts to `a` (one mode's runs over several rounds).
void Merge(RunResult& a, const RunResult& b) {
  a.seconds += b.seconds;
  a.requests += b.requests;
  a.ok += b.ok;
  for (const auto& [code, n] : b.codes) a.codes[code] += n;
  a.latency.insert(a.latency.end(), b.latency.begin(), b.latency.end());
  for (int s = 0; s < 2; ++s)
    a.stage[s].insert(a.stage[s].end(), b.stage[s].begin(), b.stage[s].end());
  a.server_seconds += b.server_seconds;
  a.bytes += b.bytes;
  a.max_send_lag = std::max(a.max_send_lag, b.max_send_lag);
  for (const auto& [size, n] : b.batch_sizes) a.batch_sizes[size] += n;
}

std::string CodeName(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

HostTensor Random(int64_t rows, int64_t cols, uint64_t seed, uint64_t stream) {
  HostTensor t = HostTensor::Zeros({rows, cols});
  gradwire::kernels::FillNormal(t.data.data(), t.numel(), seed, stream);
  return t;
}

// Forwards, steps or empty RPCs against the server, with requests encoded once per worker.
class RemoteOps {
 public:
  // Worker w calls module_ids[w % size], every call routed by its module (gradwire-route).
  // `fp8_input`: the modules' spec lets the exact wire send their input as E4M3
  // (gradwire::client::ExactWireTakesFp8); `fp8_grad`: the exact wire's grad_output form
  // (ExactWireGradForm), with column sums for a module with a `bias`; `block`: their FP8 tensors'
  // row blocks (RecipeBlockLength).
  RemoteOps(Client& client, const Options& o, const std::vector<std::string>& module_ids,
            int64_t in, int64_t out, int workers, bool fp8_input,
            gradwire::client::ExactGradForm fp8_grad, bool bias, int64_t block)
      : client_(client), flow_(o.flow) {
    using gradwire::client::WireDType;
    // Activations (input, output) and gradients (grad_output, grad_input); "fp8" is E4M3 for
    // activations and E5M2 for gradients; "exact" (host_tensor.h: WireForm) is F32 but for an
    // input and a grad_output the module casts to FP8 first, which cross as those casts.
    const WireDType dtype = o.wire == "bf16"                      ? WireDType::kBF16
                            : o.wire == "f16"                     ? WireDType::kF16
                            : o.wire == "e4m3" || o.wire == "fp8" ? WireDType::kFp8E4M3
                            : o.wire == "e5m2"                    ? WireDType::kFp8E5M2
                                                                  : WireDType::kF32;
    const WireDType grad_dtype = o.wire == "fp8" ? WireDType::kFp8E5M2 : dtype;
    for (int w = 0; w < workers; ++w) {
      v1::ForwardRequest f;
      f.set_module_id(module_ids[size_t(w) % module_ids.size()]);
      f.set_training(o.flow == "step" || o.flow == "stream");
      f.set_output_dtype(gradwire::client::ToProto(dtype));
      HostTensor x = Random(o.rows, in, o.run.seed, 2 * uint64_t(w));
      // As the client library forms them (host_tensor.h: InputForm, GradientForm).
      const gradwire::client::WireForm form =
          o.wire == "exact" ? gradwire::client::kExactWire : gradwire::client::WireForm(dtype);
      *f.mutable_input() =
          ToWire(x, gradwire::client::InputForm(form, x, true, fp8_input, block, f.training()));
      fwd_.push_back(std::move(f));
      v1::BackwardRequest b;
      b.set_grad_input_dtype(gradwire::client::ToProto(grad_dtype));
      const gradwire::client::WireForm grad_form =
          o.wire == "exact" ? gradwire::client::kExactWire : gradwire::client::WireForm(grad_dtype);
      const HostTensor dy = Random(o.rows, out, o.run.seed, 2 * uint64_t(w) + 1);
      const gradwire::client::TensorForm dy_form =
          gradwire::client::GradOutputForm(grad_form, dy, fp8_grad, bias, block);
      *b.mutable_grad_output() = ToWire(dy, dy_form);
      gradwire::client::SetColumnSums(dy_form, &b);
      bwd_.push_back(std::move(b));
    }
  }

  ~RemoteOps() {
    for (auto& s : streams_) {
      if (s) (void)s->Finish();
    }
  }

  size_t shared_workers() const { return regions_.size(); }

  // The bytes of worker w's tensors: outputs in the dtype asked for (the exact wire's input may be
  // narrower than its output).
  struct Sizes {
    uint64_t input, output, ln, grad_out, grad_in;
  };
  Sizes SizesOf(size_t w, int64_t in, int64_t out) const {
    const v1::ForwardRequest& f = fwd_[w];
    const v1::BackwardRequest& b = bwd_[w];
    auto element = [](v1::DType d) -> uint64_t {
      return d == v1::F32 ? 4 : d == v1::BF16 || d == v1::F16 ? 2 : 1;
    };
    uint64_t rows = 1;
    for (int64_t d : f.input().shape()) rows *= uint64_t(d);
    rows /= uint64_t(in);
    Sizes z;
    z.input = f.input().data().size();
    z.output = rows * uint64_t(out) * element(f.output_dtype());
    z.ln = rows * uint64_t(in) * element(f.output_dtype());
    z.grad_out = b.grad_output().data().size();
    z.grad_in = rows * uint64_t(in) * element(b.grad_input_dtype());
    return z;
  }

  // Whether a worker's tensors are large enough for shared memory to pay under "auto": a call's
  // tensors in and out together reach 64 KiB, as the client library decides (the output in its
  // own dtype, which the exact wire's input may be narrower than).
  bool SharedMemoryPays(int64_t in, int64_t out) const {
    if (fwd_.empty()) return false;
    const Sizes z = SizesOf(0, in, out);
    const bool step = flow_ == "step" || flow_ == "stream";
    const uint64_t bytes = z.input + z.output + (step ? z.grad_out + z.grad_in : 0);
    return bytes >= (uint64_t(64) << 10);
  }

  // Each worker's tensors move to a region the server makes for it (input, output, LayerNorm
  // output, grad_output, grad_input, in that order), written once here like the wire bytes.
  absl::Status UseSharedMemory(int64_t in, int64_t out) {
    for (size_t w = 0; w < fwd_.size(); ++w) {
      v1::ForwardRequest& f = fwd_[w];
      v1::BackwardRequest& b = bwd_[w];
      const Sizes z = SizesOf(w, in, out);
      const uint64_t input = z.input, output = z.output, ln = z.ln, grad_out = z.grad_out,
                     grad_in = z.grad_in;
      const uint64_t total = input + output + ln + grad_out + grad_in;
      auto region = gradwire::client::SharedRegion::Create(client_, total);
      if (!region.ok()) return region.status();
      const std::string name = (*region)->name();
      char* base = (*region)->data();
      uint64_t at = 0;
      auto move = [&](v1::Tensor* t) {
        std::memcpy(base + at, t->data().data(), t->data().size());
        *t->mutable_shared_memory() = gradwire::client::SharedRef(name, at, t->data().size());
        at += t->data().size();
        t->clear_data();
      };
      move(f.mutable_input());
      *f.mutable_output_shared_memory() = gradwire::client::SharedRef(name, at, output);
      at += output;
      *f.mutable_layernorm_output_shared_memory() = gradwire::client::SharedRef(name, at, ln);
      at += ln;
      move(b.mutable_grad_output());
      *b.mutable_grad_input_shared_memory() = gradwire::client::SharedRef(name, at, grad_in);
      regions_.push_back(std::move(*region));
    }
    return absl::OkStatus();
  }

  OpOutcome Run(int w) {
    OpOutcome o;
    if (flow_ == "stream") return RunStream(w);
    if (flow_ == "empty") {
      grpc::ClientContext ctx;
      client_.PrepareContext(&ctx);
      v1::GetServerInfoResponse resp;
      const grpc::Status s = client_.stub().GetServerInfo(&ctx, v1::GetServerInfoRequest(), &resp);
      o.code = CodeName(s.error_code());
      return o;
    }
    const auto t0 = Clock::now();
    v1::ForwardResponse fr;
    {
      grpc::ClientContext ctx;
      client_.PrepareContext(&ctx, "Forward", fwd_[w].module_id());
      const grpc::Status s = client_.stub().Forward(&ctx, fwd_[w], &fr);
      if (!s.ok()) {
        o.code = CodeName(s.error_code());
        return o;
      }
    }
    const auto t1 = Clock::now();
    o.stage_seconds[0] = std::chrono::duration<double>(t1 - t0).count();
    o.server_seconds = fr.server_seconds();
    o.batch_requests = fr.batch_requests();
    o.bytes = TensorBytes(fwd_[w].input()) + TensorBytes(fr.output());
    if (flow_ == "step") {
      bwd_[w].set_context_id(fr.context_id());
      v1::BackwardResponse br;
      grpc::ClientContext ctx;
      client_.PrepareContext(&ctx, "Backward", fwd_[w].module_id());
      const grpc::Status s = client_.stub().Backward(&ctx, bwd_[w], &br);
      if (!s.ok()) {
        o.code = CodeName(s.error_code());
        return o;
      }
      o.stage_seconds[1] = std::chrono::duration<double>(Clock::now() - t1).count();
      o.server_seconds += br.server_seconds();
      o.bytes += TensorBytes(bwd_[w].grad_output()) + TensorBytes(br.grad_input());
    }
    return o;
  }

 private:
  // A step (forward, then backward on its context) on this worker's Train stream.
  OpOutcome RunStream(int w) {
    OpOutcome o;
    if (streams_.empty()) streams_.resize(fwd_.size());
    if (!streams_[w]) streams_[w] = client_.OpenTrainStream(fwd_[w].module_id());
    gradwire::client::TrainStream& stream = *streams_[w];
    const auto t0 = Clock::now();
    v1::TrainRequest req;
    req.set_request_id(next_id_++);
    *req.mutable_forward() = fwd_[w];
    auto fail = [&](const std::string& code) {
      o.code = code;
      streams_[w].reset();  // a broken stream: the next step opens another
      return o;
    };
    if (!stream.Send(req)) return fail("UNAVAILABLE");
    auto fr = stream.Read();
    if (!fr) return fail("UNAVAILABLE");
    if (fr->code() != 0) {
      o.code = CodeName(static_cast<grpc::StatusCode>(fr->code()));
      return o;
    }
    const auto t1 = Clock::now();
    o.stage_seconds[0] = std::chrono::duration<double>(t1 - t0).count();
    o.server_seconds = fr->forward().server_seconds();
    o.bytes = TensorBytes(fwd_[w].input()) + TensorBytes(fr->forward().output());
    req.set_request_id(next_id_++);
    *req.mutable_backward() = bwd_[w];
    req.mutable_backward()->set_context_id(fr->forward().context_id());
    if (!stream.Send(req)) return fail("UNAVAILABLE");
    auto br = stream.Read();
    if (!br) return fail("UNAVAILABLE");
    if (br->code() != 0) {
      o.code = CodeName(static_cast<grpc::StatusCode>(br->code()));
      return o;
    }
    o.stage_seconds[1] = std::chrono::duration<double>(Clock::now() - t1).count();
    o.server_seconds += br->backward().server_seconds();
    o.bytes += TensorBytes(bwd_[w].grad_output()) + TensorBytes(br->backward().grad_input());
    return o;
  }

  Client& client_;
  std::string flow_;
  std::vector<v1::ForwardRequest> fwd_;
  std::vector<v1::BackwardRequest> bwd_;
  std::vector<std::unique_ptr<gradwire::client::TrainStream>> streams_;   // stream flow, per worker
  std::vector<std::unique_ptr<gradwire::client::SharedRegion>> regions_;  // per worker
  std::atomic<uint64_t> next_id_{1};
};

struct Row {
  std::string mode;  // remote | remote-shm | in-process | empty-rpc
  int concurrency = 0;
  double rate = 0;
  RunResult result;
};

double Ms(double s) { return s * 1000.0; }

nlohmann::json SummaryJson(const gradwire::load::LatencySummary& s) {
  return {{"count", s.count},    {"mean_ms", Ms(s.mean)}, {"p50_ms", Ms(s.p50)},
          {"p90_ms", Ms(s.p90)}, {"p99_ms", Ms(s.p99)},   {"p999_ms", Ms(s.p999)},
          {"max_ms", Ms(s.max)}};
}

// The mean size of the server batches the OK forwards ran in, as each forward saw it (1: none
// batched).
double MeanBatch(const RunResult& x) {
  int64_t n = 0, sum = 0;
  for (const auto& [size, count] : x.batch_sizes) {
    n += count;
    sum += size * count;
  }
  return n > 0 ? double(sum) / double(n) : 0.0;
}

nlohmann::json RowJson(const Row& r) {
  const RunResult& x = r.result;
  nlohmann::json j = {
      {"mode", r.mode},
      {"concurrency", r.concurrency},
      {"rate", r.rate},
      {"seconds", x.seconds},
      {"requests", x.requests},
      {"ok", x.ok},
      {"requests_per_s", x.seconds > 0 ? double(x.requests) / x.seconds : 0},
      {"payload_bytes_per_s", x.seconds > 0 ? double(x.bytes) / x.seconds : 0},
      {"server_compute_ms_mean", x.requests ? Ms(x.server_seconds / double(x.requests)) : 0},
      {"codes", x.codes},
      {"latency", SummaryJson(gradwire::load::Summarize(x.latency))},
      {"forward", SummaryJson(gradwire::load::Summarize(x.stage[0]))},
      {"backward", SummaryJson(gradwire::load::Summarize(x.stage[1]))}};
  if (r.rate > 0) j["max_send_lag_ms"] = Ms(x.max_send_lag);
  if (!x.batch_sizes.empty()) {
    nlohmann::json sizes = nlohmann::json::object();
    for (const auto& [size, n] : x.batch_sizes) sizes[std::to_string(size)] = n;
    j["batch_requests"] = {{"mean", MeanBatch(x)}, {"forwards_by_batch_size", sizes}};
  }
  return j;
}

void PrintTable(std::FILE* out, const std::vector<Row>& rows, const std::string& flow) {
  std::fprintf(out, "\n%-11s %5s %8s %10s %10s %9s %9s %9s %9s %9s %9s %9s %6s  %s\n", "mode",
               "conc", "rate", (flow == "step" || flow == "stream") ? "steps/s" : "req/s", "MB/s",
               "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms", "fwd p50", "bwd p50", "batch",
               "codes");
  for (const Row& r : rows) {
    const RunResult& x = r.result;
    const auto s = gradwire::load::Summarize(x.latency);
    const auto f = gradwire::load::Summarize(x.stage[0]);
    const auto b = gradwire::load::Summarize(x.stage[1]);
    std::string codes;
    for (const auto& [code, n] : x.codes)
      codes += (codes.empty() ? "" : " ") + code + "=" + std::to_string(n);
    std::fprintf(
        out, "%-11s %5d %8s %10.1f %10.2f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %6.2f  %s\n",
        r.mode.c_str(), r.concurrency,
        r.rate > 0 ? std::to_string(int64_t(r.rate)).c_str() : "closed",
        x.seconds > 0 ? double(x.requests) / x.seconds : 0.0,
        x.seconds > 0 ? double(x.bytes) / x.seconds / 1e6 : 0.0, Ms(s.p50), Ms(s.p90), Ms(s.p99),
        Ms(s.p999), Ms(s.max), Ms(f.p50), Ms(b.p50), MeanBatch(x), codes.c_str());
  }
}

// Ratios of the remote runs to their baselines at the same concurrency.
nlohmann::json Ratios(const std::vector<Row>& rows) {
  nlohmann::json out = nlohmann::json::array();
  for (const Row& r : rows) {
    if (r.mode != "remote") continue;
    nlohmann::json j = {{"concurrency", r.concurrency}};
    const double rate = r.result.seconds > 0 ? double(r.result.requests) / r.result.seconds : 0;
    const double p50 = gradwire::load::Summarize(r.result.latency).p50;
    for (const Row& b : rows) {
      if (b.concurrency != r.concurrency || b.mode == "remote") continue;
      const double brate = b.result.seconds > 0 ? double(b.result.requests) / b.result.seconds : 0;
      const double bp50 = gradwire::load::Summarize(b.result.latency).p50;
      if (b.mode == "empty-rpc") j["rate_vs_empty_rpc"] = brate > 0 ? rate / brate : 0;
      if (b.mode == "in-process") {
        j["p50_latency_vs_in_process"] = bp50 > 0 ? p50 / bp50 : 0;
        j["rate_vs_in_process"] = brate > 0 ? rate / brate : 0;
      }
    }
    out.push_back(j);
  }
  return out;
}

int Plot(const std::vector<Row>& rows, const std::string& path) {
  const std::string data = path + ".dat";
  {
    std::ofstream out(data);
    out << "# requests_per_s p50_ms p90_ms p99_ms p999_ms concurrency\n";
    for (const Row& r : rows) {
      if (r.mode != "remote") continue;
      const auto s = gradwire::load::Summarize(r.result.latency);
      out << (r.result.seconds > 0 ? double(r.result.requests) / r.result.seconds : 0) << " "
          << Ms(s.p50) << " " << Ms(s.p90) << " " << Ms(s.p99) << " " << Ms(s.p999) << " "
          << r.concurrency << "\n";
    }
  }
  const std::string script = path + ".gp";
  {
    std::ofstream gp(script);
    gp << "set terminal pngcairo size 900,600\nset output '" << path << "'\n"
       << "set title 'gradwire-load: latency percentiles against throughput'\n"
       << "set xlabel 'requests/s'\nset ylabel 'latency (ms)'\nset logscale y\nset grid\n"
       << "set key left top\n"
       << "plot '" << data << "' using 1:2 with linespoints title 'p50', '' using 1:3 with "
       << "linespoints title 'p90', '' using 1:4 with linespoints title 'p99', '' using 1:5 with "
       << "linespoints title 'p99.9', '' using 1:2:(sprintf('c=%d', $6)) with labels offset 0,1 "
          "notitle\n";
  }
  const std::string cmd = "gnuplot '" + script + "'";
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "gradwire-load: gnuplot failed (is it installed?): %s\n", cmd.c_str());
    return 1;
  }
  std::remove(script.c_str());
  std::remove(data.c_str());
  std::fprintf(stderr, "plot written to %s\n", path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  ClientOptions copts;
  double timeout_s = 30;
  std::string token_file;
  CLI::App app{
      "gradwire-load: load-tests a gradwire server with forwards (inference) or training steps "
      "(forward, then backward on its context) and reports latency percentiles, throughput and "
      "status codes; --baselines adds the same module run in this process and an empty RPC on "
      "the same server, measured in the same run."};
  app.add_option("--server", copts.server, "gradwire-server address, host:port")
      ->capture_default_str();
  app.add_option("--timeout", timeout_s, "deadline of each call, seconds")->capture_default_str();
  app.add_option("--max-message-mib", copts.max_message_mib,
                 "largest message sent or received, MiB: a step of 8192 rows x 4096 f32 carries "
                 "128 MiB each way (the server needs --max-message-mib and --max-request-bytes "
                 "as large)")
      ->check(CLI::Range(1, 2047))
      ->capture_default_str();
  app.add_option("--token-file", token_file, "bearer token file (or GRADWIRE_TOKEN)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-ca", copts.tls_ca_file, "PEM CA of the server's certificate: use TLS")
      ->check(CLI::ExistingFile);
  app.add_option("--flow", o.flow,
                 "forward: inference forwards; step: training forward then backward on its "
                 "context (two unary calls); stream: the same step on one Train stream per "
                 "worker; empty: an empty RPC (GetServerInfo)")
      ->check(CLI::IsMember({"forward", "step", "empty", "stream"}))
      ->capture_default_str();
  app.add_option("--module", o.module_id, "use this existing module instead of creating one");
  app.add_option("--modules", o.modules,
                 "create this many modules and spread the workers over them (worker w calls "
                 "module w mod N): behind a routing proxy, the load reaches every server")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str()
      ->excludes("--module");
  app.add_option("--kind", o.kind, "module to create: " + gradwire::client::KindNames())
      ->check(CLI::IsMember(gradwire::client::KindCliNames()))
      ->capture_default_str();
  app.add_option("--in", o.in_features, "in_features")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--out", o.out_features, "out_features")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--ffn", o.ffn_features, "ffn_features (layernorm-mlp)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--recipe", o.recipe,
                 "FP8 scaling of the modules it creates: " + gradwire::client::RecipeNamesJoined() +
                     " (block, mxfp8: a scale per block, docs/block-scaling.md; block-hybrid: "
                     "block with E5M2 gradients); default: the server's --default-recipe")
      ->check(CLI::IsMember(gradwire::client::RecipeNames()));
  app.add_option("--rows", o.rows, "rows (tokens) per request")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--wire-dtype", o.wire,
                 "how activations and gradients cross: exact (F32 results bit for bit; under "
                 "current scaling with margin 0, block and mxfp8, a Linear's input and every "
                 "kind's grad_output as the server's own FP8 casts of them), or "
                 "one dtype for all: f32, bf16, f16, e4m3, e5m2, fp8 (activations E4M3 and "
                 "gradients E5M2, a quarter of F32's bytes; lossy)")
      ->check(CLI::IsMember({"exact", "f32", "bf16", "f16", "fp8", "e4m3", "e5m2"}))
      ->capture_default_str();
  app.add_option("--concurrency,-c", o.run.concurrency,
                 "closed loop: requests in flight; with --rate: most in flight")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--rate", o.run.rate,
                 "open loop: requests per second (latency from intended send)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--arrivals", o.arrivals, "open-loop arrivals: constant or poisson")
      ->check(CLI::IsMember({"constant", "poisson"}))
      ->capture_default_str();
  app.add_option("--duration", o.run.duration_s, "measured seconds (after warm-up)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--count", o.run.count, "measured requests (instead of --duration)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--warmup", o.run.warmup_s, "seconds of unmeasured warm-up")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--sweep", o.sweep, "closed-loop concurrency sweep, e.g. 1,8,64")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096));
  app.add_flag("--baselines", o.baselines,
               "also run the in-process module and the empty RPC at each concurrency");
  app.add_option("--baseline-device", o.baseline_device,
                 "device of the in-process baseline: cpu, or cuda (the CUDA backend of this "
                 "build, on GPU 0) to compare with a server started with --device cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--seed", o.run.seed, "seed of the inputs and Poisson arrivals")
      ->capture_default_str();
  app.add_option("--json", o.json_path, "write the results as JSON to FILE (- for stdout)");
  app.add_option("--csv", o.csv_path, "write one CSV line per run to FILE");
  app.add_option("--plot", o.plot_path,
                 "draw latency percentiles against throughput (PNG, gnuplot)");
  app.add_flag("--keep-module", o.keep_module, "leave the created module on the server");
  app.add_option("--shared-memory", o.shared_memory,
                 "auto: when a worker's tensors reach 64 KiB, each worker passes them through a "
                 "shared-memory region the server makes for it (a server on this host, not "
                 "started with --shared-memory off), else the wire; on: always, an error when "
                 "the server cannot; off: the wire")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_option("--rounds", o.rounds,
                 "repeat each concurrency's runs (remote, then the baselines) this many times, "
                 "interleaved, and merge them: on a noisy machine the modes then see the same "
                 "conditions")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  int cpu_threads = 0;
  app.add_option("--cpu-threads", cpu_threads,
                 "the in-process baseline's CPU threads, as the server's flag (0: one per core)")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  std::string cpu_gemm_threads = "pool";
  app.add_option("--cpu-gemm-threads", cpu_gemm_threads,
                 "who splits the in-process baseline's GEMMs, as the server's flag")
      ->check(CLI::IsMember({"pool", "blas"}))
      ->capture_default_str();
  int cuda_staging_mib = 0;
  app.add_option("--cuda-staging-mib", cuda_staging_mib,
                 "the CUDA in-process baseline's pinned staging, as the server's flag (0: off)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  gradwire::load::UseServerHeapPolicy();
  gradwire::load::SetBaselineCpuThreads(cpu_threads, cpu_gemm_threads == "blas");
  gradwire::load::SetBaselineCudaStaging(cuda_staging_mib);

  o.run.poisson = o.arrivals == "poisson";
  if (o.sweep.empty()) o.sweep = {o.run.concurrency};
  if (o.run.rate > 0 && o.sweep.size() > 1) {
    std::fprintf(stderr,
                 "gradwire-load: --sweep is a closed-loop concurrency sweep; drop --rate\n");
    return 2;
  }
  if (!o.plot_path.empty() && o.sweep.size() < 2) {
    std::fprintf(stderr, "gradwire-load: --plot draws a sweep; give --sweep with 2+ values\n");
    return 2;
  }
  copts.timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000));
  if (auto token = gradwire::client::ResolveToken(token_file); token.ok()) {
    copts.token = *std::move(token);
  } else {
    std::fprintf(stderr, "gradwire-load: --token-file: %s\n",
                 std::string(token.status().message()).c_str());
    return 2;
  }
  Client client(copts);
  if (auto s = client.WaitForReady(copts.timeout); !s.ok()) {
    std::fprintf(stderr, "gradwire-load: %s\n", std::string(s.message()).c_str());
    return 1;
  }

  // The module: an existing one (its spec from the server) or a new one.
  v1::ModuleSpec spec;
  bool row_order_bias_sums = false;  // ModuleInfo's: the exact wire's grad_output form needs it
  std::string module_id = o.module_id;
  std::vector<std::string> module_ids;  // the workers' modules
  bool created = false;
  if (!module_id.empty()) {
    module_ids = {module_id};
    auto modules = client.ListModules(module_id);
    if (!modules.ok()) {
      std::fprintf(stderr, "gradwire-load: %s\n", std::string(modules.status().message()).c_str());
      return 1;
    }
    bool found = false;
    for (const auto& m : *modules) {
      if (m.module_id() == module_id) {
        spec = m.spec();
        row_order_bias_sums = m.row_order_bias_sums();
        found = true;
      }
    }
    if (!found) {
      std::fprintf(stderr, "gradwire-load: module %s is not on %s\n", module_id.c_str(),
                   copts.server.c_str());
      return 1;
    }
  } else {
    spec.set_kind(*gradwire::client::KindByName(o.kind));  // one of them: --kind checks it
    spec.set_in_features(o.in_features);
    spec.set_out_features(o.out_features);
    if (gradwire::client::KindReads(spec.kind(), "ffn_features"))
      spec.set_ffn_features(o.ffn_features);
    spec.set_bias(o.bias);
    // Unset: the server's --default-recipe, read back from the module it made (below).
    if (auto recipe = gradwire::client::RecipeSpecByName(o.recipe)) {
      *spec.mutable_recipe() = *recipe;
    }
    spec.set_seed(o.run.seed);
    spec.set_name("gradwire-load");
    if (o.flow != "empty" || o.baselines) {
      for (int i = 0; i < o.modules; ++i) {
        auto info = client.CreateModule(spec);
        if (!info.ok()) {
          std::fprintf(stderr, "gradwire-load: creating module %d of %d: %s\n", i + 1, o.modules,
                       std::string(info.status().message()).c_str());
          for (const std::string& id : module_ids) (void)client.DeleteModule(id);
          return 1;
        }
        module_ids.push_back(info->module_id());
        row_order_bias_sums = info->row_order_bias_sums();
        // The spec as the server made it (its recipe above all): the wire forms follow it.
        if (i + 1 == o.modules) spec = info->spec();
      }
      module_id = module_ids[0];
      created = true;
    }
  }
  if (module_ids.empty()) module_ids = {module_id};  // --flow empty: no module
  const std::string modules_label =
      module_ids.size() > 1
          ? std::to_string(module_ids.size()) + " modules (" + module_ids[0] + ", ...)"
          : "module " + module_id;
  std::fprintf(
      stderr, "gradwire-load: %s on %s, %s (%lld -> %lld), %lld rows, wire %s\n", o.flow.c_str(),
      copts.server.c_str(), modules_label.c_str(), static_cast<long long>(spec.in_features()),
      static_cast<long long>(spec.out_features()), static_cast<long long>(o.rows), o.wire.c_str());

  std::vector<Row> rows;
  auto run_one = [&](const std::string& mode, int concurrency,
                     const std::function<OpOutcome(int)>& op) {
    RunConfig c = o.run;
    c.concurrency = concurrency;
    const std::string label = mode + " c=" + std::to_string(concurrency);
    gradwire::cli::ProgressBar bar(stderr, 1000, label);
    RunResult result = gradwire::load::Run(c, op, [&](double f, int64_t n) {
      bar.Update(int64_t(f * 1000), std::to_string(n) + " requests");
    });
    bar.Finish(std::to_string(result.requests) + " requests");
    for (Row& r : rows) {
      if (r.mode == mode && r.concurrency == concurrency) {
        Merge(r.result, result);
        return;
      }
    }
    rows.push_back(Row{mode, concurrency, c.rate, std::move(result)});
  };
  int rc = 0;
  for (int concurrency : o.sweep) {
    for (int round = 0; round < o.rounds && rc == 0; ++round) {
      const int workers = concurrency;
      RemoteOps remote(client, o, module_ids, spec.in_features(), spec.out_features(), workers,
                       gradwire::client::ExactWireTakesFp8(spec),
                       gradwire::client::ExactWireGradForm(spec, row_order_bias_sums), spec.bias(),
                       gradwire::client::RecipeBlockLength(spec));
      bool shared = false;
      if (o.flow != "empty" &&
          (o.shared_memory == "on" ||
           (o.shared_memory == "auto" &&
            remote.SharedMemoryPays(spec.in_features(), spec.out_features())))) {
        const absl::Status s = remote.UseSharedMemory(spec.in_features(), spec.out_features());
        shared = remote.shared_workers() > 0;
        if (s.ok()) {
        } else if (o.shared_memory == "on") {
          std::fprintf(stderr, "gradwire-load: --shared-memory on: %s\n",
                       std::string(s.message()).c_str());
          rc = 1;
          break;
        } else {
          // Workers that got a region keep it; the others use the wire. Said once.
          static bool said = false;
          if (!said) {
            std::fprintf(stderr,
                         "gradwire-load: %zu of %d workers pass tensors through shared memory, "
                         "the others the wire (%s)\n",
                         remote.shared_workers(), workers, std::string(s.message()).c_str());
            said = true;
          }
        }
      }
      run_one(o.flow == "empty" ? "empty-rpc"
              : shared          ? "remote-shm"
                                : "remote",
              concurrency, [&](int w) { return remote.Run(w); });
      if (o.baselines && o.flow != "empty") {
        auto local =
            gradwire::load::InProcess::Make(spec, o.flow == "stream" ? "step" : o.flow, o.rows,
                                            workers, o.run.seed, o.baseline_device);
        if (!local.ok()) {
          std::fprintf(stderr, "gradwire-load: %s\n",
                       std::string(local.status().message()).c_str());
          rc = 1;
          break;
        }
        run_one("in-process", concurrency, [&](int w) { return (*local)->Run(w); });
        Options empty = o;
        empty.flow = "empty";
        RemoteOps ping(client, empty, module_ids, spec.in_features(), spec.out_features(), workers,
                       false, gradwire::client::ExactGradForm::kNone, false, 0);
        run_one("empty-rpc", concurrency, [&](int w) { return ping.Run(w); });
      }
    }
  }
  // The server's own view after the runs.
  nlohmann::json server_view;
  if (auto info = client.GetServerInfo(); info.ok()) {
    server_view = {{"device", info->device()},
                   {"modules", info->modules()},
                   {"live_contexts", info->live_contexts()},
                   {"context_bytes", info->context_bytes()}};
  }
  if (created && !o.keep_module) {
    for (const std::string& id : module_ids) (void)client.DeleteModule(id);
  }

  // The table goes to stdout, or to stderr when the JSON report does.
  std::FILE* table = o.json_path == "-" ? stderr : stdout;
  PrintTable(table, rows, o.flow);
  const nlohmann::json ratios = Ratios(rows);
  for (const auto& r : ratios)
    std::fprintf(table, "ratios at concurrency %s: %s\n", r["concurrency"].dump().c_str(),
                 r.dump().c_str());
  if (!server_view.is_null())
    std::fprintf(table, "server after the runs: %s\n", server_view.dump().c_str());

  nlohmann::json report = {{"flow", o.flow},
                           {"server", copts.server},
                           {"module_id", module_id},
                           {"module_ids", module_ids},
                           {"in_features", spec.in_features()},
                           {"out_features", spec.out_features()},
                           {"rows", o.rows},
                           {"wire_dtype", o.wire},
                           {"warmup_s", o.run.warmup_s},
                           {"arrivals", o.run.rate > 0 ? o.arrivals : "closed-loop"},
                           {"runs", nlohmann::json::array()},
                           {"ratios", ratios},
                           {"server_view", server_view}};
  for (const Row& r : rows) report["runs"].push_back(RowJson(r));
  if (!o.json_path.empty()) {
    if (o.json_path == "-") {
      std::cout << report.dump(2) << "\n";
    } else {
      std::ofstream(o.json_path) << report.dump(2) << "\n";
    }
  }
  if (!o.csv_path.empty()) {
    std::ofstream csv(o.csv_path);
    csv << "mode,concurrency,rate,seconds,requests,ok,requests_per_s,payload_bytes_per_s,p50_ms,"
           "p90_ms,p99_ms,p999_ms,max_ms,forward_p50_ms,backward_p50_ms\n";
    for (const Row& r : rows) {
      const nlohmann::json j = RowJson(r);
      csv << r.mode << "," << r.concurrency << "," << r.rate << "," << j["seconds"] << ","
          << j["requests"] << "," << j["ok"] << "," << j["requests_per_s"] << ","
          << j["payload_bytes_per_s"] << "," << j["latency"]["p50_ms"] << ","
          << j["latency"]["p90_ms"] << "," << j["latency"]["p99_ms"] << ","
          << j["latency"]["p999_ms"] << "," << j["latency"]["max_ms"] << ","
          << j["forward"]["p50_ms"] << "," << j["backward"]["p50_ms"] << "\n";
    }
  }
  if (!o.plot_path.empty() && Plot(rows, o.plot_path) != 0) rc = 1;
  for (const Row& r : rows) {
    if (r.result.ok != r.result.requests) rc = rc ? rc : 3;  // errors: non-zero exit
  }
  return rc;
}
