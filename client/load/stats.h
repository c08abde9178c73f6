// The load tool's statistics and schedules: latency percentiles and open-loop arrival times.
// Torch- and gRPC-free, unit-tested on synthetic timings.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace gradwire::load {

// Latency summary in seconds; zeros when there are no samples.
struct LatencySummary {
  int64_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, p999 = 0, max = 0;
};

// Nearest-rank percentile (the smallest sample with at least p% of the samples at or below it) of
// samples sorted ascending; p in [0, 100]. 0 for no samples.
double Percentile(const std::vector<double>& sorted, double p);

LatencySummary Summarize(std::vector<double> samples);

// Open-loop send times: offsets in seconds from the start, `rate` per second, evenly spaced
// (constant) or with exponential gaps (Poisson), reproducible from `seed`.
class Arrivals {
 public:
  Arrivals(double rate, bool poisson, uint64_t seed);
  // The next intended send time.
  double Next();

 private:
  double rate_;
  bool poisson_;
  double t_ = 0;
  int64_t n_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace gradwire::load
