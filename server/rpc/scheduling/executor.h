// A device executor: one worker thread per device that runs compute tasks (for a GPU it will own
// the stream). gRPC reactors hand work here and never block themselves.
//
// Tasks are queued per client (the tenant with tokens, else the peer host) and shared between
// them by weighted fair queuing on the time they actually take: each client has a virtual time
// that grows by a task's run time divided by the client's weight, and the worker always starts
// the oldest task of the client with the least virtual time. A client that joins starts at the
// current virtual time (no credit for having been idle). Within a client, tasks run in
// submission order. One busy client therefore cannot make another wait behind its whole backlog:
// a light client's task waits at most for the task running now and one turn of each other
// client, and over time each client gets device time in proportion to its weight.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gradwire::scheduling {

class DeviceExecutor {
 public:
  using Weights = std::unordered_map<std::string, double>;
  // Seconds on a monotonic clock: what a task's run time is measured with (tests give their own).
  using Clock = std::function<double()>;

  // `weights`: each client's share of the device (a client not listed weighs 1).
  explicit DeviceExecutor(std::string name, Weights weights = {}, Clock clock = nullptr);
  // Runs every task already submitted, then joins the worker.
  ~DeviceExecutor();
  DeviceExecutor(const DeviceExecutor&) = delete;
  DeviceExecutor& operator=(const DeviceExecutor&) = delete;

  // Queues `task` for `client`; never blocks on the task itself. Tasks must not throw (the
  // executor logs and drops an exception that escapes, so one bad task cannot stop the device).
  void Submit(const std::string& client, std::function<void()> task);
  // The same for work of no client in particular (housekeeping), queued as client "".
  void Submit(std::function<void()> task) { Submit(std::string(), std::move(task)); }

  // From inside a running task (on the worker): charge its run time, less `idle_seconds` it spent
  // waiting rather than computing, to these clients in proportion to their shares instead of to
  // the client that submitted it (a batch charges its members' clients by their rows, not the
  // time it waited for company).
  void ShareCurrentTask(std::vector<std::pair<std::string, double>> shares,
                        double idle_seconds = 0);
  // Called (outside the executor's lock) after every Submit: a batch waiting for company on the
  // worker stops waiting when other work arrives. Set once, before tasks are submitted.
  void SetOnSubmit(std::function<void()> hook);

  // Tasks queued and not yet started, in all and of one client.
  int64_t queued() const;
  int64_t queued(const std::string& client) const;
  // Tasks queued for clients other than these and other than housekeeping's "" (a batch
  // yielding to other clients).
  int64_t queued_besides(const std::vector<std::string>& clients) const;
  // Clients the executor keeps state for (those queued, or owing run time); tests. Idle clients
  // past kMaxClients are forgotten, debts and all.
  int64_t clients() const;
  static constexpr int64_t kMaxClients = 1024;
  const std::string& name() const { return name_; }

 private:
  struct Queue {
    std::deque<std::function<void()>> tasks;
    double vtime = 0;     // seconds of run time, divided by the weight
    uint64_t joined = 0;  // when it last went from empty to queued (ties go to the earlier)
  };
  void Run();
  double WeightOf(const std::string& client) const;

  const std::string name_;
  const Weights weights_;
  const Clock clock_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Queue> queues_;
  int64_t queued_ = 0;
  double vtime_ = 0;  // the virtual time of the task started last
  uint64_t joins_ = 0;
  bool stopping_ = false;
  // The running task's ShareCurrentTask; touched only on the worker thread.
  std::vector<std::pair<std::string, double>> shares_;
  double idle_ = 0;
  std::shared_ptr<const std::function<void()>> on_submit_;  // guarded by mu_
  std::thread worker_;
};

}  // namespace gradwire::scheduling
