// Casting fp32 tensors to FP8 with a recipe's scale.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/block_scaling.h"
#include "gradwire/kernels/ref/cast.h"
#include "gradwire/wire/codec.h"
#include "server/device/fp8_tensor.h"
#include "server/device/recipe.h"

namespace gradwire::device {

// Delayed scaling across a batch of training forwards (CastRows): each request is a step of its
// role's amax history, so request g casts with the scale the steps of requests 0 .. g-1 left.
// CastRows asks for each group's scale, in order, and reports each group's amax as one step.
struct QuantizerConfig;
class ScaleSteps {
 public:
  virtual ~ScaleSteps() = default;
  // Sets the next group's scale in `one` (scale_device under delayed scaling; nothing under
  // current scaling, whose cast takes its scale from its own amax).
  virtual void Next(QuantizerConfig& one) = 0;
  // That group's cast, with these scalars (its amax is read only where a later group's scale
  // depends on it): one step.
  virtual void Stepped(const CastScalars& cast) = 0;
};

// How one cast chooses its scale.
struct QuantizerConfig {
  kernels::Fp8Format format = kernels::Fp8Format::kE4M3;
  int margin = 0;  // headroom in powers of two (current scaling)
  // > 0: cast with exactly this scale (delayed scaling: it came from the amax history).
  // 0: current scaling, the scale comes from the tensor's own amax.
  float scale = 0.0f;
  // A batch (CastRows, fp8_ops.h): the cast's input is several requests' rows stacked, this many
  // rows each, in order. Each group is cast on its own with the settings above, exactly as it
  // would be alone, and the result is row-grouped (Fp8Tensor::groups). Null: one tensor.
  std::shared_ptr<const std::vector<int64_t>> row_groups;
  // With row_groups, a training batch: each group's scale comes from here (ScaleSteps above).
  std::shared_ptr<ScaleSteps> steps;
  // Delayed scaling from the module's scaling state on the backend's device (DeviceScaling):
  // fp32 [1] on the cast's device holding the scale, read there when the cast runs (no host
  // copy on a GPU). When defined it is the scale and `scale` is not read.
  at::Tensor scale_device;
  // A replay (ReplayOf): the scale is that of this earlier cast, read on the host when the
  // replay's cast is made. When set it is the scale, and `scale` and `scale_device` are not read.
  std::optional<CastScalars> scale_of;
  // Block scaling (BLOCK, MXFP8; docs/block-scaling.md): a power-of-two scale per block, from
  // the block's own values, so margin, scale, scale_device and scale_of are not read (a replay
  // of a block cast is the same cast of the same values). rowwise_block blocks the rowwise copy
  // [rows, cols]; columnwise_block blocks the columnwise copy as it is stored, [cols, rows].
  bool block_scaled = false;
  kernels::BlockShape rowwise_block{};
  kernels::BlockShape columnwise_block{};
};

// Makes `q` a cast of a block-scaled recipe (BlockScaled(mode)) for a weight (`weight`) or an
// activation or gradient: BLOCK 128 x 128 (weights; the columnwise copy the same blocks
// transposed) or 1 x 128 along the reducing dimension of each copy; MXFP8 1 x 32 along it.
// Every block-scaled cast is E4M3.
void SetBlockScaling(QuantizerConfig& q, ScalingMode mode, bool weight);

// True when `config` casts with a given scale (delayed scaling), not one from the input's amax.
inline bool GivenScale(const QuantizerConfig& config) {
  if (config.block_scaled) return false;
  return config.scale_of.has_value() || config.scale_device.defined() || config.scale > 0.0f;
}
// The given scale of a cast on a host backend (scale_device, when defined, is a CPU tensor
// there), or a replay's (scale_of, on any backend); 0 under current scaling.
float HostScale(const QuantizerConfig& config);

// Which copies of the FP8 data a cast writes.
struct CastUsage {
  bool rowwise = true;
  bool columnwise = false;
};

// Casts x (float32, 2-D, contiguous, CPU) to FP8 under `config`. The result's amax is the amax of
// x whatever the recipe, so delayed scaling can record it.
absl::StatusOr<Fp8Tensor> Quantize(const at::Tensor& x, const QuantizerConfig& config,
                                   CastUsage usage);

// The loops a block-scaled cast runs on: the reference's (kernels/ref/block_scaling.h) by
// default; a backend may give its own, which must compute the same bits (the CPU backend's
// threaded ones, kernels/cpu/cast.h).
struct BlockCastLoops {
  void (*quantize)(const float* x, int64_t rows, int64_t cols, kernels::BlockShape block,
                   kernels::Fp8Format format, uint8_t* out, float* scale_inv, uint8_t* out_t,
                   float* scale_inv_t) = &kernels::QuantizeBlocks;
  float (*amax)(const float* x, int64_t n) = &kernels::Amax;
  // Optional: the cast of activations and gradients in one pass, both copies blocked 1 x length
  // along their own rows (kernels::cpu::QuantizeLineBlocks), giving what quantize and amax above
  // give; run where the cast's blocks are those (QuantizeBlocked).
  void (*line)(const float* x, int64_t rows, int64_t cols, int64_t length,
               kernels::Fp8Format format, uint8_t* out, float* scale_inv, uint8_t* out_t,
               float* scale_inv_t, float* amax) = nullptr;
};
// Quantize of a block-scaled `config` (BlockScaled), on `loops`; x as Quantize's.
absl::StatusOr<Fp8Tensor> QuantizeBlockScaled(const at::Tensor& x, const QuantizerConfig& config,
                                              CastUsage usage, const BlockCastLoops& loops);

// An FP8 tensor from codes that arrived already cast (rows x cols, row-major) with their
// scale_inv: used as they are, nothing re-quantized. The columnwise copy is the exact transpose;
// amax is the largest |decoded value| x scale_inv (NaN when a code is NaN, inf for an E5M2
// infinity, as a cast of such values would measure).
Fp8Tensor FromCodes(const uint8_t* codes, int64_t rows, int64_t cols, kernels::Fp8Format format,
                    float scale_inv, CastUsage usage);

// An FP8 tensor from block-scaled codes that arrived already cast (a wire view of rows x cols
// with block scales): the rowwise copy with its blocks and scales, and the columnwise copy when
// the view has one and `usage` asks for it (nothing is cast: a columnwise copy the view lacks
// stays absent). amax is the largest |decoded value| (NaN when a code is NaN).
Fp8Tensor FromBlockCodes(const wire::TensorView& v, int64_t rows, int64_t cols, CastUsage usage);

// True when FP8 input codes as they arrived are exactly what a module under `mode` makes of its
// input (the input role's cast), so that it may compute with them as they are: one scale under
// the per-tensor recipes (CURRENT, DELAYED); under BLOCK and MXFP8, E4M3 with the role's block
// shape and power-of-two scales in the block range, and in `training` the columnwise copy too.
bool CodesServeInput(const wire::TensorView& v, ScalingMode mode, bool training);
// The same for a gradient's cast `q` (RoleQuantizer: format and blocks; its scale is not read): FP8
// of q's format; per tensor, one scale; block-scaled, q's row blocks with power-of-two scales in
// the block range and the columnwise copy in q's columnwise blocks (a backward's weight gradient
// always reads it).
bool CodesServeGradient(const wire::TensorView& v, const QuantizerConfig& q);

// The quantizer that repeats `cast` exactly (same format, same scale): what a recompute in
// backward must use so its FP8 data is bit-identical to the forward's.
// A replay is of one cast (one group of a batch): it carries no row groups or steps.
// The scale is the cast's scalars, read when the replay runs (in the backward: on a GPU they
// crossed back with the forward's result, so the read does not wait).
inline QuantizerConfig ReplayOf(const QuantizerConfig& config, const Fp8Tensor& cast) {
  QuantizerConfig replay = config;
  replay.scale = 0.0f;
  replay.scale_device = at::Tensor();
  replay.scale_of = cast.scalars;
  replay.row_groups = nullptr;
  replay.steps = nullptr;
  return replay;
}

// Decodes one stored copy back to float32 (rowwise: [rows, cols]; else [cols, rows]), with its
// tensor's scale_inv or, block-scaled, each block's.
at::Tensor Dequantize(const Fp8Tensor& t, bool rowwise);
// The same into `out` (rows * cols floats, host memory).
void DequantizeInto(const Fp8Tensor& t, bool rowwise, float* out);

}  // namespace gradwire::device
