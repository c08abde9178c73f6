// gradwire: command-line client of gradwire-server.
#include <spdlog/sinks/stdout_color_sinks.h>  // the stderr sinks too
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "demo.h"
#include "gradwire/client/client.h"
#include "gradwire/client/cluster.h"
#include "gradwire/client/recipes.h"
#include "weights.h"

namespace {

using gradwire::client::Client;
using gradwire::client::ClientOptions;

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "gradwire: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return 1;
}

// Exit 0 only when the service is SERVING: the contract of a container or Kubernetes probe.
int RunHealth(Client& client, const std::string& service, bool json) {
  auto status = client.CheckHealth(service);
  if (!status.ok()) return Fail(status.status());
  if (json) {
    std::cout << nlohmann::json{{"server", client.options().server},
                                {"service", service},
                                {"status", *status}}
                     .dump()
              << "\n";
  } else {
    std::printf("%s\n", status->c_str());
  }
  return *status == "SERVING" ? 0 : 1;
}

// The server's description of the module (ModuleInfo.description); from the spec's kind and
// widths for a server that sends none.
std::string Describe(const gradwire::v1::ModuleInfo& m) {
  if (!m.description().empty()) return m.description();
  return gradwire::v1::ModuleKind_Name(m.spec().kind()) + " " +
         std::to_string(m.spec().in_features()) + " -> " + std::to_string(m.spec().out_features());
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
                                    {"kind", gradwire::v1::ModuleKind_Name(m.spec().kind())},
                                    {"description", Describe(m)},
                                    {"in_features", m.spec().in_features()},
                                    {"out_features", m.spec().out_features()},
                                    {"bias", m.spec().bias()},
                                    {"recipe", gradwire::client::RecipeName(m.spec().recipe())},
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
    std::printf("  %s  %s  v%llu  %lld contexts  %s scaling  %s\n", m.module_id().c_str(),
                Describe(m).c_str(), static_cast<unsigned long long>(m.weight_version()),
                static_cast<long long>(m.live_contexts()),
                gradwire::client::RecipeName(m.spec().recipe()).c_str(), m.spec().name().c_str());
  }
  return 0;
}

int RunDemo(gradwire::client::Cluster& cluster, const gradwire::cli::DemoOptions& options,
            bool json) {
  Client& client = cluster.endpoint(0);
  auto info = client.GetServerInfo();
  if (!info.ok()) return Fail(info.status());
  const auto in = static_cast<long long>(options.in_features);
  const auto hidden = static_cast<long long>(options.hidden);
  const auto out = static_cast<long long>(options.out_features);
  char model[160];
  if (options.model == "mlp") {
    std::snprintf(model, sizeof model, "LayerNormMLP(%lld->%lld->%lld, gelu)", in, hidden, out);
  } else {
    std::snprintf(model, sizeof model, "Linear(%lld->%lld) -> ReLU (client) -> Linear(%lld->%lld)",
                  in, hidden, hidden, out);
  }
  std::string servers;
  for (size_t i = 0; i < cluster.size(); ++i) servers += (i ? ", " : "") + cluster.address(i);
  const std::string recipe =
      options.recipe.empty() ? "the server's default recipe" : options.recipe + " scaling";
  std::fprintf(stderr, "demo: %s, FP8 (%s), on %s (%s), batch %lld, SGD lr %g, %lld steps\n", model,
               recipe.c_str(), servers.c_str(), info->device().c_str(),
               static_cast<long long>(options.batch), options.learning_rate,
               static_cast<long long>(options.steps));
  auto result = gradwire::cli::RunDemo(cluster, options, stderr);
  if (!result.ok()) return Fail(result.status());
  if (cluster.size() > 1 && !json) {
    for (size_t i = 0; i < result->module_ids.size(); ++i) {
      std::fprintf(stderr, "module %s on %s\n", result->module_ids[i].c_str(),
                   result->module_servers[i].c_str());
    }
  }
  if (json) {
    nlohmann::json placed = nlohmann::json::array();
    for (size_t i = 0; i < result->module_ids.size(); ++i) {
      placed.push_back(
          {{"module_id", result->module_ids[i]}, {"server", result->module_servers[i]}});
    }
    nlohmann::json out = {{"initial_loss", result->initial_loss},
                          {"final_loss", result->final_loss},
                          {"steps", result->steps},
                          {"steps_per_s", result->steps_per_s},
                          {"modules", placed}};
    std::cout << out.dump() << "\n";
  } else {
    std::printf("held-out loss %.6f -> %.6f (%.1f%% lower), %lld steps at %.1f steps/s\n",
                result->initial_loss, result->final_loss,
                100.0 * (1.0 - result->final_loss / result->initial_loss),
                static_cast<long long>(result->steps), result->steps_per_s);
  }
  return 0;
}

int RunWeightsExport(Client& client, const std::string& module_id, const std::string& path,
                     bool json) {
  auto result = gradwire::cli::ExportWeights(client, module_id, path);
  if (!result.ok()) return Fail(result.status());
  std::cout << gradwire::cli::FormatExportResult(*result, json) << "\n";
  return 0;
}

int RunWeightsImport(Client& client, const std::string& module_id, const std::string& path,
                     const gradwire::cli::ImportOptions& options, bool json) {
  auto result = gradwire::cli::ImportWeights(client, module_id, path, options);
  if (!result.ok()) return Fail(result.status());
  std::cout << gradwire::cli::FormatImportResult(*result, json) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gradwire: client of gradwire-server (FP8 modules over gRPC)"};
  app.require_subcommand(1);
  ClientOptions options;
  double timeout_s = 30;
  bool json = false;
  bool verbose = false;
  std::string token_file;

  auto add_common = [&](CLI::App* cmd) {
    cmd->add_option("--server", options.server,
                    "gradwire-server address, host:port; several, comma-separated, spread the "
                    "demo's modules over them and let info/health/weights ask each")
        ->capture_default_str();
    cmd->add_option("--timeout", timeout_s, "deadline of each call, seconds")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    cmd->add_flag("--json", json, "print one JSON line instead of text");
    cmd->add_flag("--verbose,-v", verbose,
                  "log each call with its W3C traceparent on stderr: the trace-id is the call's "
                  "request id in the server's logs and errors");
    cmd->add_option("--tls-ca", options.tls_ca_file,
                    "PEM CA bundle that signed the server's certificate: connect with TLS")
        ->check(CLI::ExistingFile);
    cmd->add_option("--tls-cert", options.tls_cert_file,
                    "PEM client certificate, for a server that requires mutual TLS")
        ->check(CLI::ExistingFile);
    cmd->add_option("--tls-key", options.tls_key_file, "PEM private key of --tls-cert")
        ->check(CLI::ExistingFile);
    cmd->add_option("--tls-server-name", options.tls_server_name,
                    "name to verify in the server's certificate instead of the --server host "
                    "(e.g. a probe dialing 127.0.0.1)");
    cmd->add_option("--token-file", token_file,
                    "file holding the bearer token for a server that requires tokens (or set "
                    "GRADWIRE_TOKEN)")
        ->check(CLI::ExistingFile);
  };

  CLI::App* info = app.add_subcommand("info", "show the server's device, modules and contexts");
  add_common(info);

  std::string health_service;
  CLI::App* health = app.add_subcommand(
      "health",
      "ask the server's grpc.health.v1 service; prints SERVING/NOT_SERVING and exits 0 only when "
      "SERVING (for scripts and container probes)");
  add_common(health);
  health->add_option("--service", health_service,
                     "service to ask about, e.g. gradwire.v1.Gradwire (default: the whole server)");

  gradwire::cli::DemoOptions demo_options;
  std::string wire = "exact";
  CLI::App* demo =
      app.add_subcommand("demo",
                         "train a small model whose layers live on the server (synthetic "
                         "regression, SGD); prints the held-out loss before and after");
  add_common(demo);
  demo->add_option("--model", demo_options.model,
                   "linear: Linear -> ReLU (client) -> Linear; mlp: one LayerNormMLP")
      ->check(CLI::IsMember({"linear", "mlp"}))
      ->capture_default_str();
  demo->add_option("--recipe", demo_options.recipe,
                   "FP8 scaling recipe of the modules: " + gradwire::client::RecipeNamesJoined() +
                       " (default: the server's --default-recipe)")
      ->check(CLI::IsMember(gradwire::client::RecipeNames()));
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
  demo->add_option("--wire-dtype", wire,
                   "how activations and gradients cross: exact (F32 results bit for bit; a "
                   "Linear's input and grad_output as the server's own FP8 casts of them), or "
                   "one dtype both ways "
                   "(f32; bf16 and f16 round)")
      ->check(CLI::IsMember({"exact", "f32", "bf16", "f16"}))
      ->capture_default_str();
  demo->add_flag("--keep-modules", demo_options.keep_modules,
                 "leave the demo's modules on the server");
  demo->add_option("--placement", demo_options.placement,
                   "server index (0-based, in --server order) of each module, e.g. 1,0 puts fc1 "
                   "on the second server; default: round-robin")
      ->delimiter(',')
      ->check(CLI::NonNegativeNumber);

  std::string module_id;
  std::string weights_path;
  gradwire::cli::ImportOptions import_options;
  CLI::App* weights = app.add_subcommand(
      "weights", "copy a module's parameters to or from a safetensors file (float32, by name)");
  weights->require_subcommand(1);
  CLI::App* weights_export = weights->add_subcommand(
      "export",
      "write every parameter of a module to FILE as an F32 tensor named as the server names it "
      "(weight, bias, layer_norm_weight, fc1_weight, ...), exactly the float32 values the server "
      "holds; the metadata records the module id, weight version and shape of the module. FILE "
      "is replaced atomically");
  add_common(weights_export);
  weights_export->add_option("--module", module_id, "id of the module (see `gradwire info`)")
      ->required();
  weights_export->add_option("FILE", weights_path, "safetensors file to write")->required();
  CLI::App* weights_import = weights->add_subcommand(
      "import",
      "replace a module's parameters with the tensors of FILE and print the new weight version. "
      "Every tensor must be a parameter of the module with exactly its shape, finite, and F32 "
      "(BF16 and F16 are widened exactly; FP8 is refused); unless --partial, every parameter "
      "must be there. The file is checked before anything is sent, and a file that does not fit "
      "leaves the module unchanged");
  add_common(weights_import);
  weights_import->add_option("--module", module_id, "id of the module (see `gradwire info`)")
      ->required();
  weights_import->add_option("FILE", weights_path, "safetensors file to read")->required();
  weights_import->add_flag("--partial", import_options.partial,
                           "accept a file with only some of the parameters; the others keep "
                           "their values");

  CLI11_PARSE(app, argc, argv);
  // Logs go to stderr: stdout carries the command's output (--json included).
  spdlog::set_default_logger(spdlog::stderr_color_mt("gradwire"));
  spdlog::set_pattern("gradwire: %l: %v");
  spdlog::set_level(verbose ? spdlog::level::debug : spdlog::level::warn);
  if (auto token = gradwire::client::ResolveToken(token_file); token.ok()) {
    options.token = *std::move(token);
  } else {
    std::fprintf(stderr, "gradwire: --token-file: %s\n",
                 std::string(token.status().message()).c_str());
    return 2;
  }
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  options.wire_dtype =
      wire == "bf16"  ? gradwire::client::WireForm(gradwire::client::WireDType::kBF16)
      : wire == "f16" ? gradwire::client::WireForm(gradwire::client::WireDType::kF16)
      : wire == "f32" ? gradwire::client::WireForm(gradwire::client::WireDType::kF32)
                      : gradwire::client::kExactWire;
  auto endpoints = gradwire::client::Cluster::ParseEndpoints(options.server);
  if (!endpoints.ok()) return Fail(endpoints.status());
  gradwire::client::Cluster cluster(options, *endpoints);
  if (auto s = cluster.WaitForReady(options.timeout); !s.ok()) return Fail(s);
  for (int placed : demo_options.placement) {
    if (size_t(placed) >= cluster.size()) {
      std::fprintf(stderr, "gradwire: --placement %d: there are %zu servers (0..%zu)\n", placed,
                   cluster.size(), cluster.size() - 1);
      return 2;
    }
  }
  if (*info || *health) {
    int rc = 0;
    for (size_t i = 0; i < cluster.size(); ++i) {
      const int one = *info ? RunInfo(cluster.endpoint(i), json)
                            : RunHealth(cluster.endpoint(i), health_service, json);
      rc = rc ? rc : one;
    }
    return rc;
  }
  if (*weights_export || *weights_import) {
    auto where = cluster.Locate(module_id);
    if (!where.ok()) return Fail(where.status());
    Client& client = cluster.endpoint(*where);
    if (*weights_export) return RunWeightsExport(client, module_id, weights_path, json);
    return RunWeightsImport(client, module_id, weights_path, import_options, json);
  }
  return RunDemo(cluster, demo_options, json);
}
