#include "server/core/kinds/gradients.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <utility>

namespace gradwire::core {
namespace {

// Largest |decoded value| of a cast: codes saturate at the format's largest finite value, times
// the tensor's scale_inv or, block-scaled, the largest of its blocks'.
double MaxDecoded(const Fp8Tensor& t) {
  return double(kernels::Fp8Max(t.format)) *
         double(t.block_scaled ? t.max_scale_inv : t.scale_inv());
}

// (1 + gamma_n) for an fp32 sum of n terms, plus one rounding for the scale: |fl(sum)| is at most
// this times the sum of |terms| in any order, with or without fused multiply-adds.
double SumSlack(int64_t n) {
  const double nu = double(n + 2) * std::ldexp(1.0, -24);
  return nu < 0.5 ? 1.0 / (1.0 - nu) : INFINITY;
}

double ProductBound(int64_t n, const Fp8Tensor& a, const Fp8Tensor& b) {
  const double bound = double(n) * MaxDecoded(a) * MaxDecoded(b) * SumSlack(n);
  return std::isnan(bound) ? INFINITY : bound;
}

}  // namespace

double WgradBound(const Fp8Tensor& dy, const Fp8Tensor& x) { return ProductBound(dy.rows, dy, x); }

double DgradBound(const Fp8Tensor& dy, const Fp8Tensor& w) {
  if (!dy.grouped()) return ProductBound(dy.cols, dy, w);
  double bound = 0;
  for (const Fp8Tensor& g : dy.groups) bound = std::max(bound, DgradBound(g, w));
  return bound;
}

bool ProvablyFinite(double bound) { return bound <= 0.25 * double(FLT_MAX); }

void GradientSink::Wgrad(Param p, const Fp8Tensor& dy, const Fp8Tensor& x) {
  if (!dy.grouped() && !x.grouped()) return CollectWgrad(p, dy, x, 0);
  if (dy.groups.size() != x.groups.size()) {
    throw std::logic_error(std::string("the weight gradient of ") + ParamName(p) +
                           " got row groups that do not pair up");
  }
  for (size_t j = 0; j < dy.groups.size(); ++j) CollectWgrad(p, dy.groups[j], x.groups[j], j);
}

void GradientSink::BiasGrad(Param p, const at::Tensor& g, const Fp8Tensor& cast) {
  if (!cast.grouped()) return CollectBias(p, g, cast.scalars, 0);
  int64_t row = 0;
  for (size_t j = 0; j < cast.groups.size(); ++j) {
    const Fp8Tensor& part = cast.groups[j];
    CollectBias(p, g.narrow(0, row, part.rows), part.scalars, j);
    row += part.rows;
  }
}

void GradientSink::BiasSums(Param p, const at::Tensor& sums, const Backend& b) {
  for (int64_t j = 0; j < sums.size(0); ++j) {
    const at::Tensor row = sums.narrow(0, j, 1);
    CollectBias(p, row, b.AbsMaxLater(row), size_t(j));
  }
}

void DirectGradients::CollectWgrad(Param p, const Fp8Tensor& dy, const Fp8Tensor& x, size_t) {
  backend_.Wgrad(dy, x, targets_[p], /*accumulate=*/true);
}

void DirectGradients::CollectBias(Param p, const at::Tensor& g, const CastScalars&, size_t) {
  backend_.AccumulateBiasGrad(g, targets_[p]);
}

void DirectGradients::CollectAdd(Param p, const at::Tensor& v, size_t) {
  at::Tensor& acc = targets_[p];
  backend_.AddAbsMax(acc, v, acc);
}

void DeferredGradients::Collect(Pending p) {
  for (const Pending& q : pending_) {
    if (q.param == p.param && q.group == p.group) {
      throw std::logic_error(std::string("two gradient contributions to ") + ParamName(p.param) +
                             " in one backward");
    }
  }
  pending_.push_back(std::move(p));
}

void DeferredGradients::CollectWgrad(Param p, const Fp8Tensor& dy, const Fp8Tensor& x,
                                     size_t group) {
  Collect({Kind::kWgrad, p, dy, x, at::Tensor(), {}, group});
}

void DeferredGradients::CollectBias(Param p, const at::Tensor& g, const CastScalars& g_amax,
                                    size_t group) {
  Collect({Kind::kBias, p, {}, {}, g, g_amax, group});
}

void DeferredGradients::CollectAdd(Param p, const at::Tensor& v, size_t group) {
  // A small vector: its bound is its own max, measured (read at Commit).
  Collect({Kind::kAdd, p, {}, {}, v, backend_.AbsMaxLater(v), group});
}

double DeferredGradients::Bound(const Pending& p) {
  switch (p.kind) {
    case Kind::kWgrad:
      return WgradBound(p.dy, p.x);
    case Kind::kBias: {
      const int64_t rows = p.g.size(0);
      const double bound = double(rows) * double(p.g_amax.amax()) * SumSlack(rows);
      return std::isnan(bound) ? INFINITY : bound;
    }
    case Kind::kAdd: {
      const float amax = p.g_amax.amax();
      return std::isnan(amax) ? INFINITY : double(amax);
    }
  }
  return INFINITY;
}

std::optional<Param> DeferredGradients::Commit(
    const std::function<GradAccumulator*(Param)>& accumulator, size_t group) {
  // Contributions whose bound does not prove the sum finite are built first, in the spare
  // buffers, and checked; nothing visible changes until all of them passed.
  std::vector<std::pair<const Pending*, double>> checked;  // with the measured max |sum|
  for (const Pending& p : pending_) {
    if (p.group != group) continue;
    GradAccumulator& acc = *accumulator(p.param);
    if (ProvablyFinite(acc.bound + Bound(p))) continue;
    if (!acc.spare.defined()) acc.spare = backend_.Empty(acc.grad.sizes());
    float amax = NAN;
    switch (p.kind) {
      case Kind::kWgrad:
        backend_.Wgrad(p.dy, p.x, acc.spare, /*accumulate=*/false);
        amax = backend_.AddAbsMax(acc.grad, acc.spare, acc.spare);
        break;
      case Kind::kBias:
        acc.spare.copy_(acc.grad);
        backend_.AccumulateBiasGrad(p.g, acc.spare);
        amax = backend_.AbsMax(acc.spare);
        break;
      case Kind::kAdd:
        amax = backend_.AddAbsMax(acc.grad, p.g, acc.spare);
        break;
    }
    if (!(amax <= FLT_MAX)) return p.param;  // NaN or inf: refuse the whole backward
    checked.emplace_back(&p, double(amax));
  }
  for (const auto& [p, amax] : checked) {
    GradAccumulator& acc = *accumulator(p->param);
    std::swap(acc.grad, acc.spare);
    acc.bound = amax;
  }
  // The rest cannot overflow: straight into the accumulators.
  for (const Pending& p : pending_) {
    if (p.group != group) continue;
    bool done = false;
    for (const auto& c : checked) done |= c.first == &p;
    if (done) continue;
    GradAccumulator& acc = *accumulator(p.param);
    switch (p.kind) {
      case Kind::kWgrad:
        backend_.Wgrad(p.dy, p.x, acc.grad, /*accumulate=*/true);
        break;
      case Kind::kBias:
        backend_.AccumulateBiasGrad(p.g, acc.grad);
        break;
      case Kind::kAdd:
        // A plain add (AddAbsMax would also read its max back: on a GPU, a wait for nothing).
        acc.grad.add_(p.g);
        break;
    }
    acc.bound += Bound(p);
  }
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [group](const Pending& p) { return p.group == group; }),
                 pending_.end());
  return std::nullopt;
}

}  // namespace gradwire::core
