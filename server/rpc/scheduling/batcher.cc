#include "server/rpc/scheduling/batcher.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "server/rpc/scheduling/executor.h"

namespace gradwire::scheduling {

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

int64_t BatchFormer::waiting() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->waiting;
}

bool BatchFormer::Run::OthersWaiting() const {
  return yield_ && executor_.queued_besides(clients_) > 0;
}

void BatchFormer::Run::GiveBack(std::vector<Member>& members, size_t from) {
  for (size_t i = from; i < members.size(); ++i) given_back_.push_back(std::move(members[i]));
  members.resize(std::min(from, members.size()));
}

void BatchFormer::Add(const std::string& key, Member member, Runner run, Order* order) {
  std::shared_ptr<Open> batch;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->waiting;
    auto it = state_->open.find(key);
    bool join = it != state_->open.end() && it->second->rows + member.rows <= options_.max_rows;
    if (join && order != nullptr) {
      join = order->submitted_ ? order->last_.lock() == it->second
                               : it->second->client == member.client;
    }
    if (join) {
      Open& open = *it->second;
      open.rows += member.rows;
      open.members.push_back(std::move(member));
      if (order != nullptr) {
        open.ordered = true;
        order->submitted_ = true;
        order->last_ = it->second;
      }
      state_->joined.notify_all();
      return;
    }
    batch = std::make_shared<Open>();
    batch->first = std::chrono::steady_clock::now();
    batch->rows = member.rows;
    batch->client = member.client;
    batch->ordered = order != nullptr;
    batch->members.push_back(member);
    // A full batch, or a request bigger than a batch, runs as it is; the next request of its key
    // opens a new one. A batch a stream's request could not join stops taking requests: this one
    // is the key's open batch now.
    if (batch->rows < options_.max_rows) state_->open[key] = batch;
    if (order != nullptr) {
      order->submitted_ = true;
      order->last_ = batch;
    }
  }
  // The client is this request's own copy: once the batch is open, others join it concurrently.
  Launch(executor_, state_, options_, observer_, key, member.client, std::move(batch),
         std::move(run));
}

void BatchFormer::Launch(DeviceExecutor& executor, const std::shared_ptr<State>& state,
                         const BatchOptions& options, const Observer& observer, std::string key,
                         std::string client, std::shared_ptr<Open> batch, Runner run) {
  executor.Submit(client, [state, batch, key = std::move(key), run = std::move(run), options,
                           observer, &executor] {
    std::vector<Member> members;
    double waited = 0;
    bool given_back_before = false;
    bool ordered = false;
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
      state->waiting -= int64_t(members.size());
      given_back_before = batch->given_back;
      ordered = batch->ordered;
    }
    auto charge = [&] {
      std::vector<std::pair<std::string, double>> shares;
      for (const Member& m : members) shares.emplace_back(m.client, double(m.rows));
      executor.ShareCurrentTask(std::move(shares), waited);
    };
    charge();
    std::vector<std::string> clients;
    for (const Member& m : members) {
      if (std::find(clients.begin(), clients.end(), m.client) == clients.end()) {
        clients.push_back(m.client);
      }
    }
    // A batch holding requests given back once does not yield again: each request is cut at
    // most once, so two busy tenants cannot split each other's batches down to single requests.
    // Nor does one holding a stream's requests, which must run in their order.
    Run control(executor, std::move(clients), options.yield && !given_back_before && !ordered);
    // The rest go to the front of their key's open batch (they came first), or form a new one
    // that keeps their original start (it waited for company already). The executor has one
    // worker: the open batch's task cannot be running now, so it has not taken its members.
    auto requeue = [&] {
      std::vector<Member>& rest = control.given_back();
      if (rest.empty()) return;
      std::shared_ptr<Open> again;
      std::string first_client;
      {
        std::lock_guard<std::mutex> lock(state->mu);
        int64_t rest_rows = 0;
        for (const Member& m : rest) rest_rows += m.rows;
        state->waiting += int64_t(rest.size());
        auto it = state->open.find(key);
        if (it != state->open.end() && it->second->rows + rest_rows <= options.max_rows) {
          Open& open = *it->second;
          open.members.insert(open.members.begin(), std::make_move_iterator(rest.begin()),
                              std::make_move_iterator(rest.end()));
          open.rows += rest_rows;
          open.first = std::min(open.first, batch->first);
          open.given_back = true;
          rest.clear();
          return;
        }
        again = std::make_shared<Open>();
        again->first = batch->first;
        again->rows = rest_rows;
        again->members = std::move(rest);
        again->given_back = true;
        rest.clear();
        first_client = again->members.front().client;
        again->client = first_client;
        if (it == state->open.end() && again->rows < options.max_rows) state->open[key] = again;
      }
      Launch(executor, state, options, observer, key, first_client, std::move(again), run);
    };
    try {
      run(members, control);
    } catch (...) {
      requeue();  // what was given back still runs
      throw;
    }
    int64_t rows = 0;
    for (const Member& m : members) rows += m.rows;
    if (observer && !members.empty()) observer(int64_t(members.size()), rows);
    if (control.given_back().empty()) return;
    charge();  // only the members that ran pay for this task
    requeue();
  });
}

}  // namespace gradwire::scheduling
