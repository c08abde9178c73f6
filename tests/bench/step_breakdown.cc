// Where an in-process training step's time goes: the forward and the backward of a module through
// ModuleHost as the service calls it (an F32 wire view in, F32 wire bytes out: decode onto the
// device, casts, finite checks, gradient commit, context bookkeeping, encode), next to the pieces
// alone on the same backend and shapes: the module's GEMMs (operands cast beforehand, with the
// module's recipe), its two activation casts, the input crossing onto the device (FromWire) and
// the output leaving it (ToWire). The step and its GEMMs run in turns, round by round, and the
// step / GEMMs columns are the medians of the rounds' ratios, which a shared machine's slow and
// fast stretches move less than either time. On the CPU a step should cost little more than its
// GEMMs (docs/performance.md); on the GPU the table shows what the host side of a step costs
// next to the GPU's work (docs/cuda.md). Every timed piece ends with the backend's Synchronize.
// Prints a table; --json writes it with the machine's description.
//   step_breakdown [--device cpu|cuda] [--rows 16,256,4096] [--in 1024] [--out 1024]
//                  [--seconds 2] [--cpu-gemm blas|ordered] [--recipe block] [--json PATH]
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "gradwire/wire/codec.h"
#include "server/core/heap_trim.h"
#include "server/core/module_host.h"
#include "server/core/tensor_calls.h"
#include "server/device/backend.h"
#include "server/device/cpu_gemm.h"
#include "server/device/quantizer.h"
#include "server/device/recipe.h"

namespace {

using Clock = std::chrono::steady_clock;
using gradwire::device::Backend;
using gradwire::device::Fp8Tensor;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Median of repeated runs of fn for about `budget` seconds (at least 5 runs).
template <typename Fn>
double Median(double budget, Fn&& fn) {
  std::vector<double> times;
  const auto start = Clock::now();
  while (times.size() < 5 || Seconds(start) < budget) {
    const auto t0 = Clock::now();
    fn();
    times.push_back(Seconds(t0));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

at::Tensor RandN(int64_t rows, int64_t cols) { return at::randn({rows, cols}, at::kFloat); }

// An F32 host tensor as the service hands it to the core: a view of its bytes.
gradwire::wire::TensorView F32View(const at::Tensor& t) {
  return {gradwire::wire::DType::kF32, t.data_ptr(), {t.sizes().begin(), t.sizes().end()}, 1.0f};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("gradwire step breakdown: ModuleHost forward/backward next to their GEMMs alone");
  std::vector<int64_t> rows_list = {16, 256, 4096};
  int64_t in = 1024, out = 1024;
  double seconds = 2.0;
  std::string json_path, cpu_gemm = "ordered";  // the server's defaults
  app.add_option("--rows", rows_list, "rows per step")->delimiter(',')->capture_default_str();
  app.add_option("--in", in, "in_features")->capture_default_str();
  app.add_option("--out", out, "out_features")->capture_default_str();
  app.add_option("--seconds", seconds, "time per measurement")->capture_default_str();
  app.add_option("--cpu-gemm", cpu_gemm,
                 "the CPU GEMMs, as the server's --cpu-gemm: ordered (the FP8 GEMM, the server's "
                 "default) or blas")
      ->check(CLI::IsMember({"blas", "ordered"}))
      ->capture_default_str();
  std::string device = "cpu";
  app.add_option("--device", device, "the backend: cpu, or cuda (device 0)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  int cuda_staging_mib = 0;
  app.add_option("--cuda-staging-mib", cuda_staging_mib,
                 "--device cuda: wire crossings through pinned staging, as the server's flag")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  std::string recipe;
  app.add_option("--recipe", recipe,
                 "the module's FP8 recipe: current, delayed, block or mxfp8 (default: block, the "
                 "server's --default-recipe, on the CPU; current on CUDA, which has no "
                 "block-scaled path)")
      ->check(CLI::IsMember({"current", "delayed", "block", "mxfp8"}));
  app.add_option("--json", json_path, "write the table as JSON");
  CLI11_PARSE(app, argc, argv);
  if (recipe.empty()) recipe = device == "cuda" ? "current" : "block";
  gradwire::device::ScalingMode mode = gradwire::device::ScalingMode::kBlock;
  gradwire::device::ScalingModeByName(recipe, &mode);
  gradwire::device::SetCpuGemm(cpu_gemm == "ordered" ? gradwire::device::CpuGemm::kOrdered
                                                     : gradwire::device::CpuGemm::kBlas);
  gradwire::core::RetainLargeBlocks();
  gradwire::device::SetCpuThreads(0);
  gradwire::device::SetCudaStaging(int64_t(cuda_staging_mib) << 20);
  gradwire::device::BackendPtr backend = gradwire::device::MakeCpuBackend();
  if (device == "cuda") {
    auto cuda = gradwire::device::MakeCudaBackend(0);
    if (!cuda.ok()) {
      std::fprintf(stderr, "step_breakdown: %s\n", cuda.status().ToString().c_str());
      return 1;
    }
    backend = *cuda;
  }
  const Backend& b = *backend;
  std::printf("%s\nrecipe %s\n\n", b.Describe().c_str(), recipe.c_str());
  std::printf("%8s | %10s %10s %10s | %10s %10s %10s | %9s %9s | %8s %8s %8s %8s | %8s %8s\n",
              "rows", "fwd ms", "bwd ms", "step ms", "fprop ms", "dgrad ms", "wgrad ms", "fwd/gemm",
              "bwd/gemm", "x in ms", "y out ms", "dy in ms", "dx out ms", "x cast", "dy cast");
  struct Row {
    int64_t rows;
    double fwd = 0, bwd = 0, fprop = 0, dgrad = 0, wgrad = 0, x_in = 0, y_out = 0, dy_in = 0,
           dx_out = 0, x_cast = 0, dy_cast = 0;
    double fwd_ratio = 0, bwd_ratio = 0;   // medians of the rounds' step / GEMMs
    int64_t fwd_waits = 0, bwd_waits = 0;  // Backend::HostWaits in one forward, one backward
  };
  std::vector<Row> results;
  for (int64_t rows : rows_list) {
    gradwire::core::ModuleHost host(gradwire::core::ContextLimits{}, nullptr, backend);
    gradwire::core::ModuleSpec spec;
    spec.kind = gradwire::core::ModuleKind::kLinear;
    spec.in_features = in;
    spec.out_features = out;
    spec.bias = true;
    spec.recipe.mode = mode;
    auto info = host.Create(spec);
    if (!info.ok()) {
      std::fprintf(stderr, "%s\n", info.status().ToString().c_str());
      return 1;
    }
    const at::Tensor x = RandN(rows, in), dy = RandN(rows, out);
    const double budget = seconds / 5;
    std::string context;
    auto forward = [&] {
      gradwire::core::WireForwardRequest f;
      f.input = F32View(x);
      f.training = true;
      auto r = host.Forward(info->module_id, f);
      if (!r.ok()) {
        std::fprintf(stderr, "forward: %s\n", r.status().ToString().c_str());
        std::abort();
      }
      context = r->context_id;
    };
    auto backward = [&] {
      gradwire::core::WireBackwardRequest g;
      g.grad_output = F32View(dy);
      auto r = host.Backward(context, g);
      if (!r.ok()) {
        std::fprintf(stderr, "backward: %s\n", r.status().ToString().c_str());
        std::abort();
      }
    };
    // The GEMMs alone, on operands cast as the module casts them (the weight with what
    // PrepareWeight attaches, as the workspace holds it): its recipe's formats and blocks.
    gradwire::device::QuantizerConfig xcfg{gradwire::kernels::Fp8Format::kE4M3, 0, 0.0f, nullptr,
                                           nullptr};
    gradwire::device::QuantizerConfig wcfg = xcfg, dycfg = xcfg;
    if (gradwire::device::BlockScaled(mode)) {
      gradwire::device::SetBlockScaling(xcfg, mode, false);
      gradwire::device::SetBlockScaling(wcfg, mode, true);
      gradwire::device::SetBlockScaling(dycfg, mode, false);
    } else {
      dycfg.format = gradwire::kernels::Fp8Format::kE5M2;
    }
    const at::Tensor x_dev = b.ToDevice(x), dy_dev = b.ToDevice(dy);
    Fp8Tensor xq = *b.Cast(x_dev, xcfg, {true, true});
    Fp8Tensor wq = *b.Cast(b.ToDevice(RandN(out, in)), wcfg, {true, true});
    b.PrepareWeight(wq);
    Fp8Tensor dyq = *b.Cast(dy_dev, dycfg, {true, true});
    const at::Tensor bias = b.ToDevice(at::randn({out}, at::kFloat));
    at::Tensor acc = b.ToDevice(at::zeros({out, in}, at::kFloat));
    const at::Tensor y_dev = b.ToDevice(RandN(rows, out)), dx_dev = b.ToDevice(RandN(rows, in));
    const gradwire::device::CastUsage rowwise{true, false};
    auto timed = [](auto&& fn) {
      const auto t0 = Clock::now();
      fn();
      return Seconds(t0);
    };
    forward();
    backward();  // warm: workspace, scratch buffers
    // Each round runs the step and then its GEMMs alone, so that a slower or faster stretch of
    // a shared machine moves both: the ratios are taken round by round.
    std::vector<double> fwd_t, bwd_t, fprop_t, dgrad_t, wgrad_t, fwd_ratio, bwd_ratio;
    int64_t fwd_waits = 0, bwd_waits = 0;
    const auto start = Clock::now();
    while (fwd_t.size() < 5 || Seconds(start) < 3 * budget) {
      const int64_t w0 = b.HostWaits();
      fwd_t.push_back(timed(forward));
      const int64_t w1 = b.HostWaits();
      bwd_t.push_back(timed(backward));
      fwd_waits = w1 - w0;
      bwd_waits = b.HostWaits() - w1;
      fprop_t.push_back(timed([&] {
        (void)b.Fprop(xq, wq, bias);
        b.Synchronize();
      }));
      dgrad_t.push_back(timed([&] {
        (void)b.Dgrad(dyq, wq);
        b.Synchronize();
      }));
      wgrad_t.push_back(timed([&] {
        b.Wgrad(dyq, xq, acc, true);
        b.Synchronize();
      }));
      fwd_ratio.push_back(fwd_t.back() / fprop_t.back());
      bwd_ratio.push_back(bwd_t.back() / (dgrad_t.back() + wgrad_t.back()));
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    Row row{};
    row.rows = rows;
    row.fwd = median(fwd_t);
    row.bwd = median(bwd_t);
    row.fprop = median(fprop_t);
    row.dgrad = median(dgrad_t);
    row.wgrad = median(wgrad_t);
    row.fwd_ratio = median(fwd_ratio);
    row.bwd_ratio = median(bwd_ratio);
    row.fwd_waits = fwd_waits;
    row.bwd_waits = bwd_waits;
    // The wire crossings alone: the request's F32 bytes onto the device, the F32 result back.
    row.x_in = Median(budget, [&] {
      (void)b.FromWire(F32View(x), rows, in, nullptr, rowwise);
      b.Synchronize();
    });
    row.y_out = Median(budget, [&] {
      (void)b.ToWire(y_dev, gradwire::wire::DType::kF32, {rows, out});
    });
    row.dy_in = Median(budget, [&] {
      (void)b.FromWire(F32View(dy), rows, out, nullptr, rowwise);
      b.Synchronize();
    });
    row.dx_out = Median(budget, [&] {
      (void)b.ToWire(dx_dev, gradwire::wire::DType::kF32, {rows, in});
    });
    // A training forward's input cast and a backward's grad_output cast: both copies.
    row.x_cast = Median(budget, [&] {
      (void)b.Cast(x_dev, xcfg, {true, true});
      b.Synchronize();
    });
    row.dy_cast = Median(budget, [&] {
      (void)b.Cast(dy_dev, dycfg, {true, true});
      b.Synchronize();
    });
    results.push_back(row);
    std::printf(
        "%8lld | %10.3f %10.3f %10.3f | %10.3f %10.3f %10.3f | %9.2f %9.2f | %8.3f %8.3f %8.3f "
        "%8.3f | %8.3f %8.3f\n",
        (long long)rows, row.fwd * 1e3, row.bwd * 1e3, (row.fwd + row.bwd) * 1e3, row.fprop * 1e3,
        row.dgrad * 1e3, row.wgrad * 1e3, row.fwd_ratio, row.bwd_ratio, row.x_in * 1e3,
        row.y_out * 1e3, row.dy_in * 1e3, row.dx_out * 1e3, row.x_cast * 1e3, row.dy_cast * 1e3);
    std::printf("%8s   host waits (Backend::HostWaits): forward %lld, backward %lld\n", "",
                (long long)row.fwd_waits, (long long)row.bwd_waits);
  }
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << "{\n  \"benchmark\": \"step_breakdown\",\n  \"device\": \"" << device
      << "\",\n  \"cuda_staging_mib\": " << cuda_staging_mib << ",\n  \"backend\": \""
      << b.Describe() << "\",\n  \"recipe\": \"" << recipe << "\",\n  \"cpu_gemm\": \"" << cpu_gemm
      << "\",\n  \"in\": " << in << ", \"out\": " << out << ",\n  \"rows\": [\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const Row& r = results[i];
      f << "    {\"rows\": " << r.rows << ", \"forward_ms\": " << r.fwd * 1e3
        << ", \"backward_ms\": " << r.bwd * 1e3 << ", \"fprop_ms\": " << r.fprop * 1e3
        << ", \"dgrad_ms\": " << r.dgrad * 1e3 << ", \"wgrad_ms\": " << r.wgrad * 1e3
        << ", \"input_from_wire_ms\": " << r.x_in * 1e3
        << ", \"output_to_wire_ms\": " << r.y_out * 1e3
        << ", \"grad_output_from_wire_ms\": " << r.dy_in * 1e3
        << ", \"grad_input_to_wire_ms\": " << r.dx_out * 1e3
        << ", \"input_cast_ms\": " << r.x_cast * 1e3
        << ", \"grad_output_cast_ms\": " << r.dy_cast * 1e3
        << ", \"forward_over_fprop\": " << r.fwd_ratio
        << ", \"backward_over_gemms\": " << r.bwd_ratio
        << ", \"host_waits_forward\": " << r.fwd_waits
        << ", \"host_waits_backward\": " << r.bwd_waits << "}"
        << (i + 1 < results.size() ? "," : "") << "\n";
    }
    f << "  ]\n}\n";
  }
  return 0;
}
