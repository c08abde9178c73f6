// Dynamic batching (docs/batching.md): requests that can share one backend call (forwards of
// one module, all training or all inference, reaching it the same way) wait together for the device
// and run as one task of the device executor.
//
// A request opens a batch, queued on the executor under its client like any task, or joins the
// open batch of its key while that batch has not started and has room (max_rows). Requests of one
// stream, which must run in the order they came (Order), join only where that order holds. When the
// batch starts it closes: with a delay, and the executor otherwise idle, it first waits up to
// `delay` from its first request for company (the device would idle anyway); then its runner gets
// every member at once. The executor charges the batch's run time to the members' clients by their
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

namespace gradwire::scheduling {

class DeviceExecutor;

struct BatchOptions {
  int64_t max_rows = 0;                // rows of one batch, at most; <= 1: no batching
  std::chrono::microseconds delay{0};  // the longest a batch waits for company
  bool yield = false;                  // Run::OthersWaiting may say true (else a batch runs whole)
  bool enabled() const { return max_rows > 1; }
};

class BatchFormer {
 public:
  struct Member {
    std::string client;  // whose share of the device it costs
    int64_t rows = 0;
    std::shared_ptr<void> item;  // the runner's (the request)
  };
  // What a running batch may do besides running its members: yield to other clients. A runner
  // that works member by member asks OthersWaiting() after each and, when it is true, gives the
  // members it has not started back; they return to the front of their key's open batch (or a
  // new one), queued behind the waiting work, so a batch delays another client's call by about
  // one member's work rather than the whole batch's. The run time is then charged only to the
  // members that ran.
  class Run {
   public:
    Run(const DeviceExecutor& executor, std::vector<std::string> clients, bool yield)
        : executor_(executor), clients_(std::move(clients)), yield_(yield) {}
    // True when yielding is on for this batch and a client with no member in it has work queued
    // (housekeeping, queued as client "", does not count).
    bool OthersWaiting() const;
    // Members [from, end) leave `members` (the runner's vector) and go back.
    void GiveBack(std::vector<Member>& members, size_t from);
    std::vector<Member>& given_back() { return given_back_; }

   private:
    const DeviceExecutor& executor_;
    const std::vector<std::string> clients_;
    const bool yield_;
    std::vector<Member> given_back_;
  };
  // The requests of one stream (the Train call's), which must run in the order they came. The
  // executor serves each client's tasks in order, but a batch runs in the turn of the client that
  // opened it, and a request that joins an open batch runs before anything its stream queued
  // after that batch opened. So a request of a stream joins only the batch its stream's previous
  // request went to, and the stream's first request only a batch its own client opened; else it
  // opens a batch of its own. Batches that hold a stream's requests do not yield (a request given
  // back would run after its stream's later ones). Used by one thread at a time (a stream adds
  // one request at a time).
  class Order {
   public:
    // The stream's request went to the executor without the former: nothing may join a batch
    // opened before it.
    void Alone() {
      submitted_ = true;
      last_.reset();
    }

   private:
    friend class BatchFormer;
    bool submitted_ = false;
    std::weak_ptr<void> last_;  // the batch of the stream's previous request, if any
  };
  // Runs a batch's members (all of one key, in the order they came) on the executor's thread.
  using Runner = std::function<void(std::vector<Member>& members, Run& run)>;
  // Told of every batch that ran: its requests and rows (metrics).
  using Observer = std::function<void(int64_t requests, int64_t rows)>;

  // `executor` must outlive the batches queued on it.
  // With a delay, the former hooks the executor's submissions (SetOnSubmit); the hook holds the
  // former's state weakly, so it does nothing once the former is gone.
  BatchFormer(DeviceExecutor& executor, BatchOptions options, Observer observer = nullptr);
  BatchFormer(const BatchFormer&) = delete;
  BatchFormer& operator=(const BatchFormer&) = delete;

  const BatchOptions& options() const { return options_; }
  // Adds `member` under `key`: to the open batch of that key when it has room (and, for a stream's
  // request, `order` allows), else to a new batch whose task is queued under member.client and
  // ends in `run`.
  void Add(const std::string& key, Member member, Runner run, Order* order = nullptr);
  // Batches open now (queued, not started); tests.
  int64_t open() const;
  // Requests waiting in batches not started yet; tests.
  int64_t waiting() const;

 private:
  struct Open {
    std::vector<Member> members;
    int64_t rows = 0;
    std::chrono::steady_clock::time_point first;
    std::string client;       // under whose turn its task is queued
    bool given_back = false;  // holds requests a batch gave back: it does not yield
    bool ordered = false;     // holds a stream's request: it does not yield
  };
  struct State {
    std::mutex mu;
    std::condition_variable joined;
    std::map<std::string, std::shared_ptr<Open>> open;
    // Requests in batches not started yet: the open ones, and those a stream's request took the
    // key's place from (they no longer take requests but still wait).
    int64_t waiting = 0;
  };
  // Queues `batch`'s task on the executor under `client` (its first member's, read while the
  // batch could not change: once it is open, other requests join it concurrently).
  static void Launch(DeviceExecutor& executor, const std::shared_ptr<State>& state,
                     const BatchOptions& options, const Observer& observer, std::string key,
                     std::string client, std::shared_ptr<Open> batch, Runner run);

  DeviceExecutor& executor_;
  const BatchOptions options_;
  const Observer observer_;
  const std::shared_ptr<State> state_;
};

}  // namespace gradwire::scheduling
