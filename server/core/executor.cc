#include "server/core/executor.h"

#include <spdlog/spdlog.h>

#include <exception>

namespace gradwire::core {

DeviceExecutor::DeviceExecutor(std::string name)
    : name_(std::move(name)), worker_([this] { Run(); }) {}

DeviceExecutor::~DeviceExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void DeviceExecutor::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

int64_t DeviceExecutor::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int64_t(tasks_.size());
}

void DeviceExecutor::Run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    try {
      task();
    } catch (const std::exception& e) {
      spdlog::error("executor {}: task threw: {}", name_, e.what());
    } catch (...) {
      spdlog::error("executor {}: task threw a non-standard exception", name_);
    }
  }
}

}  // namespace gradwire::core
