#include "runner.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "stats.h"

namespace gradwire::load {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Collects measured samples from all workers.
class Collector {
 public:
  explicit Collector(int64_t count) : count_(count) {}
  // Returns false once `count` measured requests are in (count mode).
  bool Add(double latency, const OpOutcome& o, Clock::time_point done) {
    std::lock_guard<std::mutex> lock(mu_);
    if (count_ > 0 && r_.requests >= count_) return false;  // other workers finished the count
    ++r_.requests;
    ++r_.codes[o.code];
    r_.latency.push_back(latency);
    if (o.code == "OK") {
      ++r_.ok;
      for (int s = 0; s < 2; ++s) {
        if (o.stage_seconds[s] >= 0) r_.stage[s].push_back(o.stage_seconds[s]);
      }
      if (o.stage_seconds[0] >= 0) ++r_.batch_sizes[std::max(1, o.batch_requests)];
    }
    r_.server_seconds += o.server_seconds;
    r_.bytes += o.bytes;
    last_done_ = std::max(last_done_, done);
    measured_.store(r_.requests);
    return count_ <= 0 || r_.requests < count_;
  }
  int64_t measured() const { return measured_.load(); }
  RunResult Take(Clock::time_point window_start) {
    std::lock_guard<std::mutex> lock(mu_);
    r_.seconds = r_.requests ? Since(window_start, last_done_) : 0;
    return std::move(r_);
  }

 private:
  std::mutex mu_;
  RunResult r_;
  int64_t count_;
  std::atomic<int64_t> measured_{0};
  Clock::time_point last_done_{};
};

void Watch(const RunConfig& c, Clock::time_point measure_from, const Collector& collector,
           const std::atomic<bool>& stop, const std::function<void(double, int64_t)>& progress) {
  Clock::time_point last{};
  while (!stop.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto now = Clock::now();
    if (!progress || now - last < std::chrono::milliseconds(500)) continue;
    last = now;
    const double fraction =
        c.count > 0 ? double(collector.measured()) / double(c.count)
                    : std::max(0.0, Since(measure_from, now)) / std::max(c.duration_s, 1e-9);
    progress(std::clamp(fraction, 0.0, 1.0), collector.measured());
  }
}

RunResult ClosedLoop(const RunConfig& c, const Op& op,
                     const std::function<void(double, int64_t)>& progress) {
  const auto start = Clock::now();
  const auto measure_from = start + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(c.warmup_s));
  const auto end = measure_from + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(c.duration_s));
  Collector collector(c.count);
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  for (int w = 0; w < c.concurrency; ++w) {
    workers.emplace_back([&, w] {
      while (!stop.load()) {
        const auto t0 = Clock::now();
        if (c.count <= 0 && t0 >= end) break;
        const OpOutcome o = op(w);
        const auto t1 = Clock::now();
        if (t0 >= measure_from && !collector.Add(Since(t0, t1), o, t1)) stop.store(true);
      }
    });
  }
  std::atomic<bool> done{false};
  std::thread watcher(Watch, std::cref(c), measure_from, std::cref(collector), std::cref(done),
                      std::cref(progress));
  for (auto& t : workers) t.join();
  done.store(true);
  watcher.join();
  return collector.Take(measure_from);
}

RunResult OpenLoop(const RunConfig& c, const Op& op,
                   const std::function<void(double, int64_t)>& progress) {
  const auto start = Clock::now() + std::chrono::milliseconds(20);
  const auto measure_from = start + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(c.warmup_s));
  const double total_s = c.warmup_s + c.duration_s;
  Collector collector(c.count);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Clock::time_point> queue;  // intended send times not yet taken by a worker
  bool closed = false;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> lag_ns{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < c.concurrency; ++w) {
    workers.emplace_back([&, w] {
      while (true) {
        Clock::time_point intended;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return closed || !queue.empty(); });
          if (queue.empty()) return;
          intended = queue.front();
          queue.pop_front();
        }
        if (stop.load()) continue;  // drain without sending
        const auto sent = Clock::now();
        const int64_t lag =
            std::chrono::duration_cast<std::chrono::nanoseconds>(sent - intended).count();
        int64_t seen = lag_ns.load();
        while (lag > seen && !lag_ns.compare_exchange_weak(seen, lag)) {
        }
        const OpOutcome o = op(w);
        const auto t1 = Clock::now();
        if (intended >= measure_from && !collector.Add(Since(intended, t1), o, t1))
          stop.store(true);
      }
    });
  }
  std::atomic<bool> done{false};
  std::thread watcher(Watch, std::cref(c), measure_from, std::cref(collector), std::cref(done),
                      std::cref(progress));
  Arrivals arrivals(c.rate, c.poisson, c.seed);
  while (!stop.load()) {
    const double t = arrivals.Next();
    if (c.count <= 0 && t >= total_s) break;
    const auto intended =
        start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(t));
    std::this_thread::sleep_until(intended);
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(intended);
    }
    cv.notify_one();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    closed = true;
  }
  cv.notify_all();
  for (auto& t : workers) t.join();
  done.store(true);
  watcher.join();
  RunResult r = collector.Take(measure_from);
  r.max_send_lag = double(lag_ns.load()) * 1e-9;
  return r;
}

}  // namespace

RunResult Run(const RunConfig& config, const Op& op,
              const std::function<void(double, int64_t)>& progress) {
  return config.rate > 0 ? OpenLoop(config, op, progress) : ClosedLoop(config, op, progress);
}

}  // namespace gradwire::load
