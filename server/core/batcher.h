// Dynamic batching (docs/batching.md): requests that can share one backend call (forwards of
// one module, all training or all inference, reaching it the same way) wait together for the device
// and run as one task of the device executor.
//
// A request opens a batch, queued on the executor under its client like any task, or joins the
// open batch of its key while that batch has not started and has room (max_rows). When the batch
// starts it closes: with a delay, and the executor otherwise idle, it first waits up to `delay`
// from its first request for company (the device would idle anyway); then its runner gets every
// member at once. The executor charges the batch's run time to the members' clients by their
// rows, so a tenant whose requests ride in another's batch still pays for them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace gradwire::core {

class DeviceExecutor;

struct BatchOptions {
  int64_t max_rows = 0;                // rows of one batch, at most; <= 1: no batching
  std::chrono::microseconds delay{0};  // the longest a batch waits for company
  bool enabled() const { return max_rows > 1; }
};

class BatchFormer {
 public:
  struct Member {
    std::string client;  // whose share of the device it costs
    int64_t rows = 0;
    std::shared_ptr<void> item;  // the runner's (the request)
  };
  // Runs a batch's members (all of one key, in the order they came) on the executor's thread.
  using Runner = std::function<void(std::vector<Member>& members)>;
  // Told of every batch that ran: its requests and rows (metrics).
  using Observer = std::function<void(int64_t requests, int64_t rows)>;

  // `executor` must outlive the batches queued on it.
  // With a delay, the former hooks the executor's submissions (SetOnSubmit); the hook holds the
  // former's state weakly, so it does nothing once the former is gone.
  BatchFormer(DeviceExecutor& executor, BatchOptions options, Observer observer = nullptr);
  BatchFormer(const BatchFormer&) = delete;
  BatchFormer& operator=(const BatchFormer&) = delete;

  const BatchOptions& options() const { return options_; }
  // Adds `member` under `key`: to the open batch of that key when it has room, else to a new
  // batch whose task is queued under member.client and ends in `run`.
  void Add(const std::string& key, Member member, Runner run);
  // Batches open now (queued, not started); tests.
  int64_t open() const;

 private:
  struct Open {
    std::vector<Member> members;
    int64_t rows = 0;
    std::chrono::steady_clock::time_point first;
  };
  struct State {
    std::mutex mu;
    std::condition_variable joined;
    std::map<std::string, std::shared_ptr<Open>> open;
  };

  DeviceExecutor& executor_;
  const BatchOptions options_;
  const Observer observer_;
  const std::shared_ptr<State> state_;
};

}  // namespace gradwire::core
