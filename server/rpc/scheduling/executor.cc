#include "server/rpc/scheduling/executor.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <iterator>

namespace gradwire::scheduling {

DeviceExecutor::DeviceExecutor(std::string name, Weights weights, Clock clock)
    : name_(std::move(name)),
      weights_(std::move(weights)),
      clock_(clock ? std::move(clock) : Clock([] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
      })),
      worker_([this] { Run(); }) {}

DeviceExecutor::~DeviceExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

double DeviceExecutor::WeightOf(const std::string& client) const {
  auto it = weights_.find(client);
  return it == weights_.end() || !(it->second > 0) ? 1.0 : it->second;
}

void DeviceExecutor::Submit(const std::string& client, std::function<void()> task) {
  std::shared_ptr<const std::function<void()>> hook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hook = on_submit_;
    Queue& q = queues_[client];
    if (q.tasks.empty()) {
      q.vtime = std::max(q.vtime, vtime_);  // no credit for the time it was idle
      q.joined = ++joins_;
    }
    q.tasks.push_back(std::move(task));
    ++queued_;
  }
  cv_.notify_one();
  if (hook) (*hook)();
}

void DeviceExecutor::ShareCurrentTask(std::vector<std::pair<std::string, double>> shares,
                                      double idle_seconds) {
  shares_ = std::move(shares);
  idle_ = std::max(0.0, idle_seconds);
}

void DeviceExecutor::SetOnSubmit(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  on_submit_ = hook ? std::make_shared<const std::function<void()>>(std::move(hook)) : nullptr;
}

int64_t DeviceExecutor::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_;
}

int64_t DeviceExecutor::queued(const std::string& client) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = queues_.find(client);
  return it == queues_.end() ? 0 : int64_t(it->second.tasks.size());
}

int64_t DeviceExecutor::queued_besides(const std::vector<std::string>& clients) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = queued_;
  auto drop = [&](const std::string& client) {
    auto it = queues_.find(client);
    if (it != queues_.end()) n -= int64_t(it->second.tasks.size());
  };
  for (const std::string& client : clients) drop(client);
  if (std::find(clients.begin(), clients.end(), std::string()) == clients.end()) drop({});
  return n;
}

int64_t DeviceExecutor::clients() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int64_t(queues_.size());
}

void DeviceExecutor::Run() {
  for (;;) {
    std::function<void()> task;
    std::string client;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || queued_ > 0; });
      if (queued_ == 0) return;  // stopping and drained
      auto next = queues_.end();
      // Idle clients are forgotten once they owe nothing (they would rejoin at the current
      // virtual time anyway), or all at once when too many are kept.
      const bool forget_all = int64_t(queues_.size()) > kMaxClients;
      for (auto it = queues_.begin(); it != queues_.end();) {
        if (it->second.tasks.empty()) {
          it = forget_all || it->second.vtime <= vtime_ ? queues_.erase(it) : std::next(it);
          continue;
        }
        if (next == queues_.end() || it->second.vtime < next->second.vtime ||
            (it->second.vtime == next->second.vtime && it->second.joined < next->second.joined)) {
          next = it;
        }
        ++it;
      }
      client = next->first;
      vtime_ = next->second.vtime;
      task = std::move(next->second.tasks.front());
      next->second.tasks.pop_front();
      --queued_;
    }
    const double start = clock_();
    try {
      task();
    } catch (const std::exception& e) {
      spdlog::error("executor {}: task threw: {}", name_, e.what());
    } catch (...) {
      spdlog::error("executor {}: task threw a non-standard exception", name_);
    }
    task = nullptr;  // what it captured goes now, before the next task starts
    const double seconds = std::max(0.0, clock_() - start - idle_);
    idle_ = 0;
    std::vector<std::pair<std::string, double>> shares = std::move(shares_);
    shares_.clear();
    double total = 0;
    for (const auto& share : shares) total += std::max(0.0, share.second);
    if (!(total > 0)) shares = {{client, 1.0}}, total = 1.0;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [who, share] : shares) {
      Queue& q = queues_[who];  // a client whose only task rode in this one may have none left
      if (q.tasks.empty() && q.vtime < vtime_) q.vtime = vtime_;
      q.vtime += seconds * (std::max(0.0, share) / total) / WeightOf(who);
    }
    // Idle: the virtual time moves to the furthest any client has got, so clients that join
    // later start level with everyone, and idle clients owe nothing (and are forgotten).
    if (queued_ == 0) {
      for (const auto& [name, q] : queues_) vtime_ = std::max(vtime_, q.vtime);
    }
  }
}

}  // namespace gradwire::scheduling
