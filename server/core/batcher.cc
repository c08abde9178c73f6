#include "server/core/batcher.h"

#include <utility>

#include "server/core/executor.h"

namespace gradwire::core {

BatchFormer::BatchFormer(DeviceExecutor& executor, BatchOptions options, Observer observer)
    : executor_(executor),
      options_(options),
      observer_(std::move(observer)),
      state_(std::make_shared<State>()) {
  // A batch waiting for company stops waiting when other work arrives on the executor.
  if (options_.delay.count() > 0) {
    executor_.SetOnSubmit([state = std::weak_ptr<State>(state_)] {
      if (auto s = state.lock()) {
        std::lock_guard<std::mutex> lock(s->mu);
        s->joined.notify_all();
      }
    });
  }
}

int64_t BatchFormer::open() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return int64_t(state_->open.size());
}

void BatchFormer::Add(const std::string& key, Member member, Runner run) {
  std::shared_ptr<Open> batch;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->open.find(key);
    if (it != state_->open.end() && it->second->rows + member.rows <= options_.max_rows) {
      it->second->rows += member.rows;
      it->second->members.push_back(std::move(member));
      state_->joined.notify_all();
      return;
    }
    batch = std::make_shared<Open>();
    batch->first = std::chrono::steady_clock::now();
    batch->rows = member.rows;
    batch->members.push_back(member);
    // A full batch, or a request bigger than a batch, runs as it is; the next request of its key
    // opens a new one.
    if (batch->rows < options_.max_rows) state_->open[key] = batch;
  }
  executor_.Submit(member.client, [state = state_, batch, key, run = std::move(run),
                                   options = options_, observer = observer_,
                                   &executor = executor_] {
    std::vector<Member> members;
    double waited = 0;
    {
      std::unique_lock<std::mutex> lock(state->mu);
      if (options.delay.count() > 0 && batch->rows < options.max_rows && executor.queued() == 0) {
        const auto since = std::chrono::steady_clock::now();
        state->joined.wait_until(lock, batch->first + options.delay, [&] {
          return batch->rows >= options.max_rows || executor.queued() > 0;
        });
        waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
      }
      auto it = state->open.find(key);
      if (it != state->open.end() && it->second == batch) state->open.erase(it);
      members = std::move(batch->members);
    }
    std::vector<std::pair<std::string, double>> shares;
    for (const Member& m : members) shares.emplace_back(m.client, double(m.rows));
    executor.ShareCurrentTask(std::move(shares), waited);
    if (observer) observer(int64_t(members.size()), batch->rows);
    run(members);
  });
}

}  // namespace gradwire::core
