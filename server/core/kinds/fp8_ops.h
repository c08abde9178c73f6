// The FP8 weight workspace every module kind composes: the weights of one weight version cast
// once (rowwise, and columnwise for training) on the module's backend, the slim part a saved
// context keeps, and how a backward reads it. The GEMMs themselves are the backend's.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/kinds/device_names.h"
#include "server/core/kinds/saved_tensors.h"
#include "server/device/backend.h"
#include "server/device/fp8_tensor.h"
#include "server/device/quantizer.h"

namespace gradwire::core {

// What a backward needs from the weights of one weight version: the FP8 weights (one per linear
// layer, in order) and fp32 copies of the small parameters it reads (LayerNorm gamma and beta,
// FC1's bias), so a context keeps computing with its own version after an optimizer step.
struct WeightWorkspace {
  uint64_t weight_version = 0;
  std::vector<Fp8Tensor> weights;  // rowwise always; columnwise too when built for training
  std::vector<at::Tensor> aux;     // fp32 copies, in the order the module passed them
  // On a workspace built for training: the part of it a saved context keeps (see
  // PinForBackward). It shares the columnwise codes and aux and holds nothing else, so a weight
  // version that only contexts still use costs one byte per weight instead of the whole
  // workspace (rowwise codes and, on the CPU backend, two packed float copies).
  std::shared_ptr<const WeightWorkspace> for_backward;
  // On that slim part: the full workspace's input-gradient panels (CPU backend), held weakly. A
  // backward reads them while the version is still cached; after that it packs W^T itself.
  std::vector<std::weak_ptr<const kernels::cpu::GemmPanels>> dgrad_panels;
  // The same for block-scaled weights (panels of the dequantized values).
  std::vector<std::weak_ptr<const ValuePanels>> dgrad_value_panels;
  bool has_columnwise() const;
  // FP8 codes and aux bytes: what the workspace holds on the device.
  int64_t bytes() const;
};
using WorkspacePtr = std::shared_ptr<const WeightWorkspace>;

// What a training forward's context should keep of `ws`: its slim backward part, or `ws` itself
// when the backward reads rowwise weights too (a checkpointed LayerNormMLP recomputes FC1) or `ws`
// has no slim part.
WorkspacePtr PinForBackward(const WorkspacePtr& ws, bool needs_rowwise = false);

// Weight `i` of a pinned workspace as a backward reads it: the codes, with the packed panels
// that are still alive.
Fp8Tensor BackwardWeight(const WeightWorkspace& ws, size_t i);

// Saved state that pins a weight workspace (PinForBackward's result): the context store counts
// the workspace once across the contexts that share it.
struct SavedWithWorkspace : SavedTensors {
  WorkspacePtr workspace;
  const void* shared_key() const override { return workspace.get(); }
  int64_t shared_bytes() const override { return workspace ? workspace->bytes() : 0; }
};

// True when `ws` can serve a forward of `weight_version` (training needs the columnwise copies).
bool WorkspaceUsable(const WorkspacePtr& ws, uint64_t weight_version, bool training);

struct WorkspaceResult {
  WorkspacePtr workspace;
  bool built = false;  // a cache miss: the weights were cast now
};

// Returns `cached` when usable, else casts `weights` (float32 [N, K] each, on the backend's
// device) with `quantizers` on `backend` and copies `aux` (undefined entries stay undefined).
absl::StatusOr<WorkspaceResult> GetOrBuildWorkspace(const Backend& backend,
                                                    const WorkspacePtr& cached,
                                                    uint64_t weight_version, bool training,
                                                    const std::vector<at::Tensor>& weights,
                                                    const std::vector<QuantizerConfig>& quantizers,
                                                    const std::vector<at::Tensor>& aux = {});

// Batches (docs/batching.md). A cast that honours config.row_groups: each group of rows cast on
// its own by `backend.Cast`, exactly as alone, the result row-grouped; without row_groups, just
// backend.Cast. INTERNAL when the groups do not add up to x's rows.
absl::StatusOr<Fp8Tensor> CastRows(const Backend& backend, const at::Tensor& x,
                                   const QuantizerConfig& config, CastUsage usage);
// The backend's fused forms (Backend::LayerNormCast, ActivationCast, DActivationCast) for a
// config that may be row-grouped: ungrouped, the fused form itself; grouped, the op over all the
// rows, then CastRows. The same bits either way, as a fused form equals its composed default.
absl::StatusOr<Fp8Tensor> LayerNormCastRows(const Backend& backend, const at::Tensor& x,
                                            const LayerNormParams& ln,
                                            const QuantizerConfig& config, CastUsage usage,
                                            bool keep_y, LayerNormOut* ln_out);
absl::StatusOr<Fp8Tensor> ActivationCastRows(const Backend& backend, kernels::Activation act,
                                             const at::Tensor& in, int64_t width,
                                             const QuantizerConfig& config, CastUsage usage,
                                             at::Tensor* y);
absl::StatusOr<Fp8Tensor> DActivationCastRows(const Backend& backend, kernels::Activation act,
                                              const at::Tensor& dout, const at::Tensor& in,
                                              int64_t width, const QuantizerConfig& config,
                                              CastUsage usage, at::Tensor* din);
// A tensor stacking `parts` (each [rows_i, cols], one per request) by rows: row-grouped when
// there are several, the part itself when there is one.
Fp8Tensor StackRows(std::vector<Fp8Tensor> parts);
// Rows [row, row + rows) of t, a copy of their own (what one request of a batch keeps).
at::Tensor RowsOf(const at::Tensor& t, int64_t row, int64_t rows);
// y = x . w^T (+ bias) for x row-grouped or not: Backend::FpropGroups or Backend::Fprop. With
// bf16, y in bfloat16 (a module's output for a bf16 response): FpropBf16, or NarrowBf16 of
// FpropGroups. With `into` defined (KindForwardArgs::output_into) and x not grouped and not bf16,
// y is written there (Backend::FpropInto) and `into` is returned.
at::Tensor FpropRows(const Backend& backend, const Fp8Tensor& x, const Fp8Tensor& w,
                     const at::Tensor& bias, bool bf16 = false, const at::Tensor& into = {});

// dx = dy . w for dy row-grouped or not: Backend::DgradGroups or Backend::Dgrad; into `into` as
// FpropRows.
at::Tensor DgradRows(const Backend& backend, const Fp8Tensor& dy, const Fp8Tensor& w,
                     const at::Tensor& into = {});

// The backend a module's arguments name, or the reference backend when they name none.
const Backend& BackendOr(const Backend* backend);

// Flattens [..., last] to a contiguous float32 [rows, last].
at::Tensor As2D(const at::Tensor& t);

}  // namespace gradwire::core
