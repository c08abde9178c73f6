#include "gradwire/kernels/cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace gradwire::kernels::cpu {
namespace {

int HardwareThreads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? int(n) : 1;
}

// True on a thread while it runs a range of a job: a ParallelFor from there runs serially.
thread_local bool t_in_job = false;

class Pool {
 public:
  static Pool& Instance() {
    // Never destroyed: workers may still be parked in the condition variable at exit.
    static Pool* pool = new Pool();
    return *pool;
  }

  int threads() const { return threads_.load(std::memory_order_relaxed); }

  void SetThreads(int threads) {
    std::lock_guard<std::mutex> job(job_mu_);
    StopWorkers();
    threads_.store(std::clamp(threads > 0 ? threads : HardwareThreads(), 1, kMaxThreads));
  }

  // Runs task(i) for i in [0, ranges) on the caller and the workers. False when the pool is busy
  // with another caller's job (the caller then runs the ranges itself).
  bool TryRun(int64_t ranges, const std::function<void(int64_t)>& task) {
    std::unique_lock<std::mutex> job(job_mu_, std::try_to_lock);
    if (!job.owns_lock()) return false;
    StartWorkers();
    uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = &task;
      ranges_ = ranges;
      next_ = 0;
      pending_ = ranges;
      error_ = nullptr;
      generation = ++generation_;
    }
    work_cv_.notify_all();
    Work(generation);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
    task_ = nullptr;
    std::exception_ptr error = error_;
    error_ = nullptr;
    lock.unlock();
    if (error) std::rethrow_exception(error);
    return true;
  }

 private:
  Pool() : threads_(std::min(HardwareThreads(), kMaxThreads)) {}

  // Takes ranges of job `generation` until none is left. Each range is claimed under mu_ against
  // the job's generation, so a worker that wakes late never runs a range of a newer job with an
  // older job's task.
  void Work(uint64_t generation) {
    t_in_job = true;
    for (;;) {
      const std::function<void(int64_t)>* task;
      int64_t i;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (generation_ != generation || next_ >= ranges_) break;
        i = next_++;
        task = task_;
      }
      std::exception_ptr error;
      try {
        (*task)(i);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (error && !error_) error_ = error;
      if (--pending_ == 0) done_cv_.notify_all();
    }
    t_in_job = false;
  }

  void WorkerLoop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      Work(seen);
    }
  }

  // Under job_mu_.
  void StartWorkers() {
    const int want = threads() - 1;
    if (int(workers_.size()) == want) return;
    StopWorkers();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = false;
    }
    for (int i = 0; i < want; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  // Under job_mu_.
  void StopWorkers() {
    if (workers_.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : workers_) t.join();
    workers_.clear();
  }

  std::atomic<int> threads_;
  std::mutex job_mu_;  // one job at a time; also guards workers_
  std::vector<std::thread> workers_;
  std::mutex mu_;  // guards what follows
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t ranges_ = 0;
  int64_t next_ = 0;
  int64_t pending_ = 0;
  std::exception_ptr error_;
};

}  // namespace

void SetThreads(int threads) { Pool::Instance().SetThreads(threads); }

int Threads() { return Pool::Instance().threads(); }

int64_t Ranges(int64_t n, int64_t grain) {
  if (n <= 0) return 0;
  grain = std::max<int64_t>(1, grain);
  if (n < 2 * grain || t_in_job) return 1;
  return std::min<int64_t>(Threads(), n / grain);
}

void ParallelForRanges(int64_t n, int64_t grain,
                       const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const int64_t ranges = Ranges(n, grain);
  if (ranges == 0) return;
  if (ranges == 1) {
    fn(0, 0, n);
    return;
  }
  const std::function<void(int64_t)> task = [&](int64_t i) {
    fn(i, n * i / ranges, n * (i + 1) / ranges);
  };
  if (Pool::Instance().TryRun(ranges, task)) return;
  // The pool is busy with another caller's job: the same ranges, serially, here.
  for (int64_t i = 0; i < ranges; ++i) task(i);
}

void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  ParallelForRanges(n, grain, [&](int64_t, int64_t b, int64_t e) { fn(b, e); });
}

}  // namespace gradwire::kernels::cpu
