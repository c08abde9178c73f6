// libFuzzer target: the server's safetensors import, i.e. restoring a module from a checkpoint
// file (Checkpointer::RestoreAll: safetensors parse, metadata JSON, spec, parameters, optimizer
// slots and scaling state into ModuleHost::ImportState). Failures must be clean statuses; a
// restored module must be one CreateModule could have made: a valid spec (enums in range), its
// parameters with their shapes, and a working forward and backward.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "server/core/checkpoints/checkpoint.h"
#include "server/core/module_host.h"
#include "server/core/tensor_calls.h"

namespace {

namespace fs = std::filesystem;
using gradwire::core::ModuleHost;
using gradwire::core::ModuleKind;
using gradwire::device::AmaxAlgo;
using gradwire::device::ScalingMode;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "checkpoint_fuzzer invariant broken: %s\n", what.c_str());
  std::abort();
}

const std::string& Dir() {
  static const std::string dir = [] {
    const fs::path base = fs::is_directory("/dev/shm") ? "/dev/shm" : fs::temp_directory_path();
    const fs::path d = base / ("gradwire-checkpoint-fuzz-" + std::to_string(getpid()));
    fs::create_directories(d);
    return d.string();
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  gradwire::core::Checkpointer checkpointer(Dir(), 0);
  const std::string path = checkpointer.layout().LegacyPathOf("m1");
  // The file is read in the flat layout (as epoch 0); the last run's take-over claim goes.
  fs::remove_all(checkpointer.layout().FolderOf("m1"));
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
    if (!out) Fail("cannot write " + path);
  }
  ModuleHost host;
  auto restored = checkpointer.RestoreAll(host);
  if (!restored.ok()) {
    const auto code = restored.status().code();
    if (code != absl::StatusCode::kDataLoss && code != absl::StatusCode::kInvalidArgument) {
      Fail("restore returned " + restored.status().ToString());
    }
    if (!host.List().empty()) Fail("a failed restore left a module");
    return 0;
  }
  if (*restored != 1 || host.List().size() != 1) Fail("restored count");
  const gradwire::core::ModuleInfo info = host.List()[0];
  const auto& spec = info.spec;
  if (int(spec.kind) < 0 || int(spec.kind) > int(ModuleKind::kLayerNormMlp)) {
    Fail("restored a module of kind " + std::to_string(int(spec.kind)));
  }
  if (int(spec.activation) < 0 || int(spec.activation) > 3) {
    Fail("restored a module with activation " + std::to_string(int(spec.activation)));
  }
  if (int(spec.recipe.mode) < 0 || int(spec.recipe.mode) > int(ScalingMode::kMxfp8) ||
      int(spec.recipe.algo) < 0 || int(spec.recipe.algo) > int(AmaxAlgo::kMostRecent) ||
      int(spec.optimizer.kind) < 0 || int(spec.optimizer.kind) > 1) {
    Fail("restored a module with an out-of-range recipe or optimizer");
  }
  // A restored module must compute like a created one: small modules only, to stay fast.
  if (spec.in_features * std::max(spec.out_features, spec.ffn_features) <= (1 << 16)) {
    at::Tensor x = at::rand({2, spec.in_features});
    const auto scaling = host.Scaling(info.module_id);
    auto fwd = gradwire::core::TensorForward(host, info.module_id, x, true);
    if (fwd.status().code() == absl::StatusCode::kOutOfRange) {
      // Restored weights may be huge finite values whose products overflow fp32 on the way (an
      // FC1 output, an activation): the documented refusal, which must leave no context and the
      // scaling state as it was.
      if (fwd.status().message().find("non-finite") == absl::string_view::npos) {
        Fail("an OUT_OF_RANGE forward does not say why: " + fwd.status().ToString());
      }
      if (host.Stats().live_contexts != 0) Fail("a refused forward left a context");
      const auto after = host.Scaling(info.module_id);
      if (!scaling.ok() || !after.ok() || scaling->size() != after->size()) {
        Fail("scaling state unreadable after a refused forward");
      }
      for (size_t i = 0; i < after->size(); ++i) {
        if ((*after)[i].history != (*scaling)[i].history) Fail("a refused forward moved a history");
      }
      return 0;
    }
    if (!fwd.ok()) Fail("forward on a restored module: " + fwd.status().ToString());
    auto back = gradwire::core::TensorBackward(host, fwd->context_id, at::ones_like(fwd->output),
                                               false, false);
    if (back.status().code() == absl::StatusCode::kOutOfRange) {
      // Restored weights may be huge finite values whose gradients overflow fp32: the documented
      // refusal, which must accumulate nothing and keep the context for the caller to release.
      auto grads = gradwire::core::TensorGradients(host, info.module_id, false);
      if (!grads.ok()) Fail("gradients after a refused backward: " + grads.status().ToString());
      for (const auto& [name, g] : grads->tensors) {
        if (g.abs().max().item<float>() != 0.0f) Fail("a refused backward accumulated " + name);
      }
      if (!host.ReleaseContext(fwd->context_id).ok()) Fail("a refused backward lost its context");
    } else if (!back.ok()) {
      Fail("backward on a restored module: " + back.status().ToString());
    }
  }
  if (!host.ExportState(info.module_id).ok()) Fail("export of a restored module");
  return 0;
}
