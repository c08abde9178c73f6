// A device executor: one worker thread per device that runs compute tasks in submission order
// (for a GPU it will own the stream). gRPC reactors hand work here and never block themselves.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace gradwire::core {

class DeviceExecutor {
 public:
  explicit DeviceExecutor(std::string name);
  // Runs every task already submitted, then joins the worker.
  ~DeviceExecutor();
  DeviceExecutor(const DeviceExecutor&) = delete;
  DeviceExecutor& operator=(const DeviceExecutor&) = delete;

  // Queues `task`; never blocks on the task itself. Tasks must not throw (the executor logs and
  // drops an exception that escapes, so one bad task cannot stop the device).
  void Submit(std::function<void()> task);

  // Tasks queued and not yet started.
  int64_t queued() const;
  const std::string& name() const { return name_; }

 private:
  void Run();

  const std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace gradwire::core
