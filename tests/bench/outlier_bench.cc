// One outlier against each FP8 recipe (docs/block-scaling.md, scripts/bench-outlier.sh): a Linear
// 256 -> 128 with bias on the CPU backend, in process, and batches of 32 rows of N(0, 1). Each
// recipe's module first takes three clean training steps; then, for each of:
//   clean     a clean batch,
//   outlier   the same batch with one element of 3e6 in row 0,
//   after_1   a new clean batch, the step after the outlier,
//   after_2   another,
// a training forward, and the worst relative error of rows 1..31 (per row: the largest
// |y - ref| over the largest |ref|) against the float64 product of the unquantized input and
// weights plus the bias. Prints a table and, with --json, writes it.
//   outlier_bench [--json PATH] [--seed N]
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "server/core/module_host.h"
#include "server/core/tensor_calls.h"
#include "server/device/backend.h"

namespace gw = gradwire::core;

namespace {

constexpr int64_t kIn = 256, kOut = 128, kRows = 32;
constexpr float kOutlier = 3e6f;

double WorstOtherRows(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                      const at::Tensor& b) {
  const at::Tensor ref =
      x.to(at::kDouble).mm(w.to(at::kDouble).t()) + b.to(at::kDouble);  // unquantized
  const at::Tensor rows = ref.narrow(0, 1, kRows - 1);
  const at::Tensor err =
      (y.to(at::kDouble).narrow(0, 1, kRows - 1) - rows).abs().amax(1) / rows.abs().amax(1);
  return err.max().item<double>();
}

struct Row {
  const char* name;
  gw::ScalingMode mode;
  double clean = 0, outlier = 0, after_1 = 0, after_2 = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  uint64_t seed = 7;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: outlier_bench [--json PATH] [--seed N]\n");
      return 2;
    }
  }
  at::manual_seed(seed);
  std::vector<Row> rows = {{"CURRENT", gw::ScalingMode::kCurrent},
                           {"DELAYED", gw::ScalingMode::kDelayed},
                           {"BLOCK", gw::ScalingMode::kBlock},
                           {"MXFP8", gw::ScalingMode::kMxfp8}};
  // The same batches for every recipe.
  std::vector<at::Tensor> warmup;
  for (int i = 0; i < 3; ++i) warmup.push_back(at::randn({kRows, kIn}));
  const at::Tensor clean = at::randn({kRows, kIn});
  at::Tensor dirty = clean.clone();
  dirty[0][kIn / 3] = kOutlier;
  const at::Tensor next_1 = at::randn({kRows, kIn}), next_2 = at::randn({kRows, kIn});
  for (Row& r : rows) {
    gw::ModuleHost host(gw::ContextLimits{}, nullptr, gw::MakeCpuBackend());
    gw::ModuleSpec spec;
    spec.kind = gw::ModuleKind::kLinear;
    spec.in_features = kIn;
    spec.out_features = kOut;
    spec.bias = true;
    spec.seed = seed;
    spec.recipe.mode = r.mode;
    spec.recipe.history_len = 16;
    auto info = host.Create(spec);
    if (!info.ok()) {
      std::fprintf(stderr, "%s: %s\n", r.name, info.status().ToString().c_str());
      return 1;
    }
    auto weights = gw::TensorWeights(host, info->module_id);
    if (!weights.ok()) return 1;
    at::Tensor w, b;
    for (const auto& [name, t] : weights->tensors) (name == "weight" ? w : b) = t;
    // One training step: a forward whose context is released (the backward would not change the
    // weights without an optimizer step; delayed scaling records and rolls its amaxes).
    auto step = [&](const at::Tensor& x) {
      auto f = gw::TensorForward(host, info->module_id, x, true);
      if (!f.ok()) {
        std::fprintf(stderr, "%s: %s\n", r.name, f.status().ToString().c_str());
        std::exit(1);
      }
      (void)host.ReleaseContext(f->context_id);
      return WorstOtherRows(f->output, x, w, b);
    };
    for (const at::Tensor& x : warmup) step(x);
    r.clean = step(clean);
    r.outlier = step(dirty);
    r.after_1 = step(next_1);
    r.after_2 = step(next_2);
  }
  std::printf(
      "Linear %lld -> %lld, %lld rows, one %.0e in row 0: worst relative error of rows "
      "1..%lld\n",
      static_cast<long long>(kIn), static_cast<long long>(kOut), static_cast<long long>(kRows),
      double(kOutlier), static_cast<long long>(kRows - 1));
  std::printf("%-8s %10s %10s %10s %10s %12s\n", "recipe", "clean", "outlier", "after_1", "after_2",
              "outlier/clean");
  for (const Row& r : rows) {
    std::printf("%-8s %10.4f %10.4f %10.4f %10.4f %12.3f\n", r.name, r.clean, r.outlier, r.after_1,
                r.after_2, r.outlier / r.clean);
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << "{\n  \"shape\": {\"in\": " << kIn << ", \"out\": " << kOut << ", \"rows\": " << kRows
        << ", \"outlier\": " << double(kOutlier) << ", \"seed\": " << seed << "},\n";
    out << "  \"recipes\": {\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      char line[256];
      std::snprintf(line, sizeof line,
                    "    \"%s\": {\"clean\": %.6g, \"outlier\": %.6g, \"after_1\": %.6g, "
                    "\"after_2\": %.6g}%s\n",
                    r.name, r.clean, r.outlier, r.after_1, r.after_2,
                    i + 1 < rows.size() ? "," : "");
      out << line;
    }
    out << "  }\n}\n";
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      return 1;
    }
  }
  return 0;
}
