#include "server/core/gradients.h"

#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <utility>

namespace gradwire::core {
namespace {

// Largest |decoded value| of a cast: codes saturate at the format's largest finite value.
double MaxDecoded(const Fp8Tensor& t) {
  return double(kernels::Fp8Max(t.format)) * double(t.scale_inv);
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

double DgradBound(const Fp8Tensor& dy, const Fp8Tensor& w) { return ProductBound(dy.cols, dy, w); }

bool ProvablyFinite(double bound) { return bound <= 0.25 * double(FLT_MAX); }

void DirectGradients::Wgrad(Param p, const Fp8Tensor& dy, const Fp8Tensor& x) {
  backend_.Wgrad(dy, x, targets_[p], /*accumulate=*/true);
}

void DirectGradients::BiasGrad(Param p, const at::Tensor& g, float) {
  backend_.AccumulateBiasGrad(g, targets_[p]);
}

void DirectGradients::Add(Param p, const at::Tensor& v) {
  at::Tensor& acc = targets_[p];
  backend_.AddAbsMax(acc, v, acc);
}

void DeferredGradients::Collect(Pending p) {
  for (const Pending& q : pending_) {
    if (q.param == p.param) {
      throw std::logic_error(std::string("two gradient contributions to ") + ParamName(p.param) +
                             " in one backward");
    }
  }
  pending_.push_back(std::move(p));
}

void DeferredGradients::Wgrad(Param p, const Fp8Tensor& dy, const Fp8Tensor& x) {
  Collect({Kind::kWgrad, p, dy, x, at::Tensor(), WgradBound(dy, x)});
}

void DeferredGradients::BiasGrad(Param p, const at::Tensor& g, float g_amax) {
  const int64_t rows = g.size(0);
  double bound = double(rows) * double(g_amax) * SumSlack(rows);
  if (std::isnan(bound)) bound = INFINITY;
  Collect({Kind::kBias, p, {}, {}, g, bound});
}

void DeferredGradients::Add(Param p, const at::Tensor& v) {
  // A small vector: its bound is its own max, measured.
  const float amax = backend_.AbsMax(v);
  Collect({Kind::kAdd, p, {}, {}, v, std::isnan(amax) ? INFINITY : double(amax)});
}

std::optional<Param> DeferredGradients::Commit(
    const std::function<GradAccumulator*(Param)>& accumulator) {
  // Contributions whose bound does not prove the sum finite are built first, in the spare
  // buffers, and checked; nothing visible changes until all of them passed.
  std::vector<std::pair<const Pending*, double>> checked;  // with the measured max |sum|
  for (const Pending& p : pending_) {
    GradAccumulator& acc = *accumulator(p.param);
    if (ProvablyFinite(acc.bound + p.bound)) continue;
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
        backend_.AddAbsMax(acc.grad, p.g, acc.grad);
        break;
    }
    acc.bound += p.bound;
  }
  pending_.clear();
  return std::nullopt;
}

}  // namespace gradwire::core
