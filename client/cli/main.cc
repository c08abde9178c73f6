// gradwire: command-line client of gradwire-server.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "demo.h"
#include "gradwire/client/client.h"

namespace {

using gradwire::client::Client;
using gradwire::client::ClientOptions;

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "gradwire: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return 1;
}

int RunInfo(Client& client, bool json) {
  auto info = client.GetServerInfo();
  if (!info.ok()) return Fail(info.status());
  auto modules = client.ListModules();
  if (!modules.ok()) return Fail(modules.status());
  if (json) {
    nlohmann::json out = {{"server", client.options().server},
                          {"version", info->version()},
                          {"device", info->device()},
                          {"device_name", info->device_name()},
                          {"modules", info->modules()},
                          {"live_contexts", info->live_contexts()},
                          {"context_bytes", info->context_bytes()}};
    out["module_list"] = nlohmann::json::array();
    for (const auto& m : *modules) {
      out["module_list"].push_back({{"module_id", m.module_id()},
                                    {"name", m.spec().name()},
                                    {"in_features", m.spec().in_features()},
                                    {"out_features", m.spec().out_features()},
                                    {"bias", m.spec().bias()},
                                    {"weight_version", m.weight_version()},
                                    {"live_contexts", m.live_contexts()}});
    }
    std::cout << out.dump() << "\n";
    return 0;
  }
  std::printf("server         %s\n", client.options().server.c_str());
  std::printf("version        %s\n", info->version().c_str());
  std::printf("device         %s (%s)\n", info->device().c_str(), info->device_name().c_str());
  std::printf("modules        %lld\n", static_cast<long long>(info->modules()));
  std::printf("live contexts  %lld (%lld bytes saved)\n",
              static_cast<long long>(info->live_contexts()),
              static_cast<long long>(info->context_bytes()));
  for (const auto& m : *modules) {
    std::printf("  %s  Linear %lld -> %lld%s  v%llu  %lld contexts  %s\n", m.module_id().c_str(),
                static_cast<long long>(m.spec().in_features()),
                static_cast<long long>(m.spec().out_features()), m.spec().bias() ? " +bias" : "",
                static_cast<unsigned long long>(m.weight_version()),
                static_cast<long long>(m.live_contexts()), m.spec().name().c_str());
  }
  return 0;
}

int RunDemo(Client& client, const gradwire::cli::DemoOptions& options, bool json) {
  auto info = client.GetServerInfo();
  if (!info.ok()) return Fail(info.status());
  std::fprintf(stderr,
               "demo: Linear(%lld->%lld) -> ReLU (client) -> Linear(%lld->%lld) on %s (%s), "
               "batch %lld, SGD lr %g, %lld steps\n",
               static_cast<long long>(options.in_features), static_cast<long long>(options.hidden),
               static_cast<long long>(options.hidden), static_cast<long long>(options.out_features),
               client.options().server.c_str(), info->device().c_str(),
               static_cast<long long>(options.batch), options.learning_rate,
               static_cast<long long>(options.steps));
  auto result = gradwire::cli::RunDemo(client, options, stderr);
  if (!result.ok()) return Fail(result.status());
  if (json) {
    nlohmann::json out = {{"initial_loss", result->initial_loss},
                          {"final_loss", result->final_loss},
                          {"steps", result->steps},
                          {"steps_per_s", result->steps_per_s}};
    std::cout << out.dump() << "\n";
  } else {
    std::printf("held-out loss %.6f -> %.6f (%.1f%% lower), %lld steps at %.1f steps/s\n",
                result->initial_loss, result->final_loss,
                100.0 * (1.0 - result->final_loss / result->initial_loss),
                static_cast<long long>(result->steps), result->steps_per_s);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gradwire: client of gradwire-server (FP8 modules over gRPC)"};
  app.require_subcommand(1);
  ClientOptions options;
  double timeout_s = 30;
  bool json = false;

  auto add_common = [&](CLI::App* cmd) {
    cmd->add_option("--server", options.server, "gradwire-server address, host:port")
        ->capture_default_str();
    cmd->add_option("--timeout", timeout_s, "deadline of each call, seconds")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    cmd->add_flag("--json", json, "print one JSON line instead of text");
  };

  CLI::App* info = app.add_subcommand("info", "show the server's device, modules and contexts");
  add_common(info);

  gradwire::cli::DemoOptions demo_options;
  std::string wire = "f32";
  CLI::App* demo = app.add_subcommand(
      "demo",
      "train a small two-layer model whose Linear layers live on the server (synthetic "
      "regression, SGD); prints the held-out loss before and after");
  add_common(demo);
  demo->add_option("--steps", demo_options.steps, "training steps")
      ->check(CLI::Range(int64_t(1), int64_t(1000000)))
      ->capture_default_str();
  demo->add_option("--batch", demo_options.batch, "samples per step")
      ->check(CLI::Range(int64_t(1), int64_t(65536)))
      ->capture_default_str();
  demo->add_option("--hidden", demo_options.hidden, "hidden width")
      ->check(CLI::Range(int64_t(1), int64_t(65536)))
      ->capture_default_str();
  demo->add_option("--lr", demo_options.learning_rate, "SGD learning rate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  demo->add_option("--seed", demo_options.seed, "seed of data, task and weights")
      ->capture_default_str();
  demo->add_option("--wire-dtype", wire, "dtype of activations and gradients on the wire")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  demo->add_flag("--keep-modules", demo_options.keep_modules,
                 "leave the demo's modules on the server");

  CLI11_PARSE(app, argc, argv);
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  options.wire_dtype = wire == "bf16"  ? gradwire::client::WireDType::kBF16
                       : wire == "f16" ? gradwire::client::WireDType::kF16
                                       : gradwire::client::WireDType::kF32;
  Client client(options);
  if (auto s = client.WaitForReady(options.timeout); !s.ok()) return Fail(s);
  if (*info) return RunInfo(client, json);
  return RunDemo(client, demo_options, json);
}
