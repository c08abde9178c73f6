#include "stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace gradwire::load {

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double n = double(sorted.size());
  // Rank ceil(p/100 * n), 1-based; p = 0 is the minimum.
  int64_t rank = int64_t(std::ceil(p / 100.0 * n - 1e-9));
  rank = std::clamp<int64_t>(rank, 1, int64_t(sorted.size()));
  return sorted[size_t(rank - 1)];
}

LatencySummary Summarize(std::vector<double> samples) {
  LatencySummary s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  s.count = int64_t(samples.size());
  s.mean = std::accumulate(samples.begin(), samples.end(), 0.0) / double(samples.size());
  s.p50 = Percentile(samples, 50);
  s.p90 = Percentile(samples, 90);
  s.p99 = Percentile(samples, 99);
  s.p999 = Percentile(samples, 99.9);
  s.max = samples.back();
  return s;
}

Arrivals::Arrivals(double rate, bool poisson, uint64_t seed)
    : rate_(rate), poisson_(poisson), rng_(seed) {}

double Arrivals::Next() {
  if (!poisson_) return double(n_++) / rate_;  // no accumulated rounding drift
  std::exponential_distribution<double> gap(rate_);
  const double t = t_;
  t_ += gap(rng_);
  return t;
}

}  // namespace gradwire::load
