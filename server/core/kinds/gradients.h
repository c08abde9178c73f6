// Where a backward's parameter gradients go.
//
// A kind's backward hands each gradient contribution to a GradientSink, keyed by parameter, and
// never touches an accumulator itself. ModuleHost gives it a DeferredGradients, which collects the
// contributions and commits them after the backward has checked its results: all of them, or
// none when one would make an accumulator non-finite. Most commits need no check at all: the FP8
// casts bound every GEMM input (|decoded value| <= fp8 max * scale_inv), so a weight gradient's
// magnitude is bounded before it is computed, and when that bound, added to what the accumulator
// is known to hold, stays far below FLT_MAX the GEMM accumulates straight into the accumulator.
// Only a contribution whose bound does not prove it finite is built in a spare buffer, checked in
// the same pass that adds it, and swapped in.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <vector>

#include "server/core/kinds/device_names.h"
#include "server/core/kinds/params.h"
#include "server/device/backend.h"
#include "server/device/fp8_tensor.h"

namespace gradwire::core {

class GradientSink {
 public:
  virtual ~GradientSink() = default;
  // acc(p)[N, K] += dy^T . x: the weight-gradient GEMM of dy [M, N] and x [M, K], both given with
  // their columnwise copies. At most one contribution per parameter and backward. Row-grouped
  // (a batch of backwards): one contribution per group, each that group's request's.
  void Wgrad(Param p, const Fp8Tensor& dy, const Fp8Tensor& x);
  // acc(p)[N] += column sums of g [M, N], every |g| being at most g_amax.
  void BiasGrad(Param p, const at::Tensor& g, float g_amax) {
    CollectBias(p, g, CastScalars(1.0f, 1.0f, g_amax), 0);
  }
  // The same for g the unquantized input of `cast` (its amax bounds g): row-grouped with it, one
  // contribution per group.
  void BiasGrad(Param p, const at::Tensor& g, const Fp8Tensor& cast);
  // acc(p)[N] += row j of `sums` [groups, N] for request j of a batch (row 0 alone): column sums
  // made elsewhere (BackwardRequest.grad_output_column_sums). Their bound is their own max,
  // measured on `b`.
  void BiasSums(Param p, const at::Tensor& sums, const Backend& b);
  // acc(p) += v, a gradient computed whole (LayerNorm's gamma and beta), for request `group` of
  // a batch (0 alone).
  void Add(Param p, const at::Tensor& v, size_t group = 0) { CollectAdd(p, v, group); }

 protected:
  virtual void CollectWgrad(Param p, const Fp8Tensor& dy, const Fp8Tensor& x, size_t group) = 0;
  // g_amax.amax() bounds |g|; it is read only when the bound is needed (on a GPU, a cast's amax
  // is read back when first asked for).
  virtual void CollectBias(Param p, const at::Tensor& g, const CastScalars& g_amax,
                           size_t group) = 0;
  virtual void CollectAdd(Param p, const at::Tensor& v, size_t group) = 0;
};

// Accumulates each contribution at once into the tensors of a table, unchecked: for tests and
// tools that call the compute functions directly. A batch's groups add up in their order.
class DirectGradients final : public GradientSink {
 public:
  DirectGradients(const Backend& backend, ParamTable targets)
      : backend_(backend), targets_(std::move(targets)) {}

 protected:
  void CollectWgrad(Param p, const Fp8Tensor& dy, const Fp8Tensor& x, size_t group) override;
  void CollectBias(Param p, const at::Tensor& g, const CastScalars& g_amax, size_t group) override;
  void CollectAdd(Param p, const at::Tensor& v, size_t group) override;

 private:
  const Backend& backend_;
  ParamTable targets_;
};

// A bound on every |value| of dy^T . x (the sum runs over dy's rows), and of dy . w (over dy's
// columns), from the casts' scales: the rounding of an fp32 sum of n terms included. +inf when
// no useful bound exists. A row-grouped dy: the largest of its groups' bounds.
double WgradBound(const Fp8Tensor& dy, const Fp8Tensor& x);
double DgradBound(const Fp8Tensor& dy, const Fp8Tensor& w);
// True when values bounded by `bound` are finite in fp32 with room to spare (a quarter of
// FLT_MAX), so that adding another such value cannot overflow either.
bool ProvablyFinite(double bound);

// One parameter's gradient accumulator, as ModuleHost keeps it.
struct GradAccumulator {
  at::Tensor grad;   // fp32 on the backend's device: the sum so far
  at::Tensor spare;  // same shape, made on first need: where a checked sum is built
  double bound = 0;  // at least max |grad|; 0 when grad is zero
};

// Collects a backward's contributions, then commits them all or none (ModuleHost). A batch of
// backwards commits one request (group) at a time, in order: exactly the sequence's sums.
class DeferredGradients final : public GradientSink {
 public:
  explicit DeferredGradients(const Backend& backend) : backend_(backend) {}

  // Adds every contribution of `group` to its accumulator (accumulator(p), never null for a
  // collected p), or none: returns the parameter whose sum would have come out non-finite (then
  // no accumulator changed), or nullopt when every sum was added.
  std::optional<Param> Commit(const std::function<GradAccumulator*(Param)>& accumulator,
                              size_t group = 0);

 protected:
  void CollectWgrad(Param p, const Fp8Tensor& dy, const Fp8Tensor& x, size_t group) override;
  void CollectBias(Param p, const at::Tensor& g, const CastScalars& g_amax, size_t group) override;
  void CollectAdd(Param p, const at::Tensor& v, size_t group) override;

 private:
  enum class Kind { kWgrad, kBias, kAdd };
  struct Pending {
    Kind kind;
    Param param;
    Fp8Tensor dy, x;  // kWgrad
    at::Tensor g;     // kBias: the gradient summed; kAdd: the vector added
    // kBias: its amax() bounds |g|; kAdd: its amax() is max |g| (Backend::AbsMaxLater). Bounds
    // are worked out at Commit (Bound), after every kernel of the backward is queued, so a GPU's
    // values are read back then, not between them.
    CastScalars g_amax;
    size_t group = 0;
  };
  void Collect(Pending p);
  static double Bound(const Pending& p);

  const Backend& backend_;
  std::vector<Pending> pending_;
};

}  // namespace gradwire::core
