// What a client asks for when it creates a module: the kind and its dimensions, the FP8 recipe,
// the optimizer. Fixed at creation. Which fields a kind reads, and what it checks, is the kind's
// (module_kind.h).
#pragma once

#include <cstdint>
#include <string>

#include "gradwire/kernels/activation.h"
#include "server/core/optimizer_config.h"
#include "server/device/recipe.h"

namespace gradwire::core {

using device::AmaxAlgo;
using device::BlockScaled;
using device::Hybrid;
using device::RecipeConfig;
using device::ScalingMode;
using device::ScalingModeByName;
using device::ScalingModeName;

enum class ModuleKind { kLinear, kLayerNormLinear, kLayerNormMlp };
// LayerNormMLP's activation (the kernels define the functions; the spec names them).
using Activation = kernels::Activation;

// Bounds on what a spec may ask for.
inline constexpr int64_t kMaxFeatures = 1 << 16;             // any one dimension
inline constexpr int64_t kMaxParameters = int64_t(1) << 28;  // 1 GiB of fp32 per module

struct ModuleSpec {
  ModuleKind kind = ModuleKind::kLinear;
  int64_t in_features = 0;
  int64_t out_features = 0;
  int64_t ffn_features = 0;  // LayerNormMLP: the activation's output width
  bool bias = true;
  Activation activation = Activation::kGelu;  // LayerNormMLP
  float layernorm_eps = 1e-5f;
  bool zero_centered_gamma = false;
  bool return_layernorm_output = false;
  bool checkpoint = false;  // selective recompute
  RecipeConfig recipe;
  OptimizerConfig optimizer;
  int64_t max_staleness = -1;  // < 0: a backward may come from any older weight version
  uint64_t seed = 0;           // deterministic initialisation
  std::string name;            // free-form label
};

}  // namespace gradwire::core
