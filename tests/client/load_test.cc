// gradwire-load's statistics and schedules on synthetic timings.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

#include "runner.h"
#include "stats.h"

namespace gradwire::load {
namespace {

TEST(PercentileTest, NearestRankOnKnownSamples) {
  std::vector<double> v;
  for (int i = 1; i <= 1000; ++i) v.push_back(i);
  EXPECT_EQ(Percentile(v, 50), 500);
  EXPECT_EQ(Percentile(v, 90), 900);
  EXPECT_EQ(Percentile(v, 99), 990);
  EXPECT_EQ(Percentile(v, 99.9), 999);
  EXPECT_EQ(Percentile(v, 100), 1000);
  EXPECT_EQ(Percentile(v, 0), 1);
  EXPECT_EQ(Percentile({}, 50), 0);
  EXPECT_EQ(Percentile({7.0}, 99.9), 7.0);
  // Ten samples: p90 is the 9th, p99 and p99.9 the 10th.
  std::vector<double> ten = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  EXPECT_EQ(Percentile(ten, 90), 9);
  EXPECT_EQ(Percentile(ten, 99), 10);
}

TEST(PercentileTest, SummaryOfUnsortedSamplesWithATail) {
  std::vector<double> v(990, 0.001);
  for (int i = 0; i < 10; ++i) v.push_back(0.5);  // 1% slow
  std::swap(v[3], v[995]);
  const LatencySummary s = Summarize(v);
  EXPECT_EQ(s.count, 1000);
  EXPECT_DOUBLE_EQ(s.p50, 0.001);
  EXPECT_DOUBLE_EQ(s.p90, 0.001);
  EXPECT_DOUBLE_EQ(s.p99, 0.001);  // the 990th of 1000
  EXPECT_DOUBLE_EQ(s.p999, 0.5);
  EXPECT_DOUBLE_EQ(s.max, 0.5);
  EXPECT_NEAR(s.mean, (990 * 0.001 + 10 * 0.5) / 1000, 1e-12);
}

TEST(ArrivalsTest, ConstantRateIsEvenlySpaced) {
  Arrivals a(250.0, false, 1);
  for (int i = 0; i < 1000; ++i) EXPECT_DOUBLE_EQ(a.Next(), i / 250.0);
}

TEST(ArrivalsTest, PoissonGapsHaveTheRateAndAnExponentialSpread) {
  const double rate = 400;
  Arrivals a(rate, true, 42);
  const int n = 200000;
  std::vector<double> gaps;
  double prev = a.Next();
  EXPECT_EQ(prev, 0.0);
  for (int i = 0; i < n; ++i) {
    const double t = a.Next();
    gaps.push_back(t - prev);
    prev = t;
  }
  double mean = 0, var = 0;
  for (double g : gaps) mean += g;
  mean /= n;
  for (double g : gaps) var += (g - mean) * (g - mean);
  var /= n;
  EXPECT_NEAR(mean, 1 / rate, 0.01 / rate);
  EXPECT_NEAR(std::sqrt(var) / mean, 1.0, 0.02);  // exponential: coefficient of variation 1
  // The same seed gives the same schedule.
  Arrivals b(rate, true, 42), c(rate, true, 42);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(b.Next(), c.Next());
}

TEST(RunnerTest, ClosedLoopCountsRequestsCodesAndStages) {
  RunConfig c;
  c.concurrency = 3;
  c.count = 300;
  c.warmup_s = 0;
  std::atomic<int> calls{0};
  RunResult r = load::Run(c,
                          [&](int worker) {
                            EXPECT_GE(worker, 0);
                            EXPECT_LT(worker, 3);
                            OpOutcome o;
                            const int n = calls++;
                            if (n % 10 == 0) {
                              o.code = "UNAVAILABLE";
                            } else {
                              o.stage_seconds = {0.001, 0.002};
                              o.bytes = 100;
                            }
                            return o;
                          },
                          {});
  EXPECT_EQ(r.requests, 300);
  EXPECT_EQ(r.latency.size(), 300u);
  EXPECT_EQ(r.codes["UNAVAILABLE"] + r.codes["OK"], 300);
  EXPECT_EQ(r.ok, r.codes["OK"]);
  EXPECT_EQ(r.stage[0].size(), size_t(r.ok));
  EXPECT_EQ(r.bytes, 100 * r.ok);
  EXPECT_GT(r.codes["UNAVAILABLE"], 20);
}

TEST(RunnerTest, WarmUpRequestsAreNotMeasured) {
  RunConfig c;
  c.concurrency = 1;
  c.warmup_s = 0.2;
  c.duration_s = 0.2;
  std::atomic<int> calls{0};
  RunResult r = load::Run(c,
                          [&](int) {
                            ++calls;
                            std::this_thread::sleep_for(std::chrono::milliseconds(5));
                            return OpOutcome{};
                          },
                          {});
  // The first call starts inside the warm-up, so at least one call is never measured; how many
  // fit each window depends on how busy the machine is, so only their order is checked.
  EXPECT_GE(calls.load(), r.requests + 1);
  EXPECT_GT(r.requests, 0);
  EXPECT_EQ(r.latency.size(), size_t(r.requests));
}

// Open loop measures from the intended send time: one request that stalls the only worker for
// 300 ms delays every request scheduled meanwhile, and their latencies say so. A closed-loop
// client would have sent nothing during the stall and reported one slow request.
TEST(RunnerTest, OpenLoopLatencyIncludesTheWaitBehindAStall) {
  RunConfig c;
  c.concurrency = 1;
  c.rate = 100;  // one every 10 ms
  c.duration_s = 1.0;
  c.warmup_s = 0;
  std::atomic<int> calls{0};
  RunResult r = load::Run(c,
                          [&](int) {
                            if (calls++ == 20)
                              std::this_thread::sleep_for(std::chrono::milliseconds(300));
                            return OpOutcome{};
                          },
                          {});
  EXPECT_NEAR(double(r.requests), 100, 3);  // every scheduled request was sent and counted
  int delayed = 0;
  for (double l : r.latency) delayed += l > 0.1;
  // ~30 requests were due during the stall; the ones due early in it waited > 100 ms.
  EXPECT_GE(delayed, 15);
  EXPECT_GE(Summarize(r.latency).max, 0.25);
  EXPECT_GE(r.max_send_lag, 0.2);
}

}  // namespace
}  // namespace gradwire::load
