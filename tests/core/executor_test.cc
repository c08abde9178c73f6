// The device executor's scheduling: submission order within a client, weighted fair shares of
// run time between clients, no credit for idle time, no state kept for clients gone idle, and a
// shared task charged by shares; and the batch former in front of it.
#include "server/rpc/scheduling/executor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/rpc/scheduling/batcher.h"

namespace gradwire::scheduling {
namespace {

// Records which client's task ran, in order, on a clock of its own that a task advances by its
// cost: the run times the executor measures are exact, whatever the machine's load.
class Log {
 public:
  DeviceExecutor::Clock clock() {
    return [this] { return now_.load(); };
  }
  std::function<void()> Task(const std::string& client, double cost = 0) {
    return [this, client, cost] {
      now_.store(now_.load() + cost);
      std::lock_guard<std::mutex> lock(mu_);
      order_.push_back(client);
    };
  }
  std::vector<std::string> order() const {
    std::lock_guard<std::mutex> lock(mu_);
    return order_;
  }

 private:
  std::atomic<double> now_{0};
  mutable std::mutex mu_;
  std::vector<std::string> order_;
};

// Holds the worker in a task until Open(), so a test can queue everything first. Submit returns
// once the worker is inside it.
struct Gate {
  std::promise<void> open, entered;
  std::shared_future<void> opened = open.get_future().share();
  void Submit(DeviceExecutor& executor) {
    executor.Submit("gate", [this, f = opened] {
      entered.set_value();
      f.wait();
    });
    entered.get_future().wait();
  }
  void Open() { open.set_value(); }
};

// Returns when every task submitted so far has finished. (A task submitted now would be a new
// client's and could run before the queued ones: it is submitted once none is left queued, and
// then runs after the one running.)
void Drain(DeviceExecutor& executor) {
  while (executor.queued() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::promise<void> done;
  executor.Submit("drain", [&done] { done.set_value(); });
  done.get_future().wait();
}

TEST(ExecutorTest, OneClientsTasksRunInSubmissionOrder) {
  Log log;
  std::vector<std::string> want;
  {
    DeviceExecutor executor("test");
    for (int i = 0; i < 200; ++i) {
      want.push_back("c" + std::to_string(i));
      executor.Submit("client", [&log, name = want.back()] { log.Task(name)(); });
    }
  }  // the destructor runs what was queued
  EXPECT_EQ(log.order(), want);
}

TEST(ExecutorTest, ALightClientDoesNotWaitBehindAHeavyBacklog) {
  Log log;
  DeviceExecutor executor("test", {}, log.clock());
  Gate gate;
  gate.Submit(executor);
  for (int i = 0; i < 32; ++i) executor.Submit("heavy", log.Task("heavy", 1e-3));
  executor.Submit("light", log.Task("light", 1e-3));
  EXPECT_EQ(executor.queued(), 33);
  EXPECT_EQ(executor.queued("heavy"), 32);
  EXPECT_EQ(executor.queued("light"), 1);
  gate.Open();
  Drain(executor);
  const std::vector<std::string> order = log.order();
  ASSERT_EQ(order.size(), 33u);
  // In arrival order it would run 33rd; here it waits for one heavy task at most.
  int light_at = -1;
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i] == "light") light_at = int(i);
  }
  EXPECT_LE(light_at, 1);
  EXPECT_GE(light_at, 0);
}

TEST(ExecutorTest, ClientsShareRunTimeByWeight) {
  Log log;
  DeviceExecutor executor("test", {{"a", 3.0}}, log.clock());  // "b" weighs 1
  Gate gate;
  gate.Submit(executor);
  // "a" queues all of its tasks first: in arrival order it would have the first 40 runs.
  for (int i = 0; i < 40; ++i) executor.Submit("a", log.Task("a", 2e-3));
  for (int i = 0; i < 40; ++i) executor.Submit("b", log.Task("b", 2e-3));
  gate.Open();
  Drain(executor);
  const std::vector<std::string> order = log.order();
  ASSERT_EQ(order.size(), 80u);
  int a_first = 0;
  for (int i = 0; i < 40; ++i) a_first += order[size_t(i)] == "a";
  // Three of every four runs while both are queued (30 of 40); equal weights would give 20.
  EXPECT_GE(a_first, 29) << "a ran " << a_first << " of the first 40";
  EXPECT_LE(a_first, 31) << "a ran " << a_first << " of the first 40";
}

TEST(ExecutorTest, AClientThatWasIdleGetsNoCredit) {
  Log log;
  DeviceExecutor executor("test", {}, log.clock());
  for (int i = 0; i < 20; ++i) executor.Submit("a", log.Task("a", 1e-3));
  Drain(executor);
  // "b" was idle while "a" ran alone; now both queue 20 tasks: they alternate, and "b" does not
  // get a run of its own to catch up.
  Gate gate;
  gate.Submit(executor);
  for (int i = 0; i < 20; ++i) executor.Submit("b", log.Task("b", 1e-3));
  for (int i = 0; i < 20; ++i) executor.Submit("a", log.Task("a", 1e-3));
  gate.Open();
  Drain(executor);
  const std::vector<std::string> order = log.order();
  ASSERT_EQ(order.size(), 60u);
  int longest_b = 0, run = 0, b_in_first_20 = 0;
  for (size_t i = 20; i < order.size(); ++i) {
    run = order[i] == "b" ? run + 1 : 0;
    longest_b = std::max(longest_b, run);
    if (i < 40) b_in_first_20 += order[i] == "b";
  }
  EXPECT_LE(longest_b, 1);
  EXPECT_GE(b_in_first_20, 9);
  EXPECT_LE(b_in_first_20, 11);
}

TEST(ExecutorTest, TheStateKeptForIdleClientsIsBounded) {
  Log log;
  DeviceExecutor executor("test", {}, log.clock());
  // One-off clients, one after another: each leaves owing its task's run time.
  for (int i = 0; i < 3000; ++i) {
    std::promise<void> done;
    executor.Submit("client-" + std::to_string(i), [&done, task = log.Task("x", 1e-3)] {
      task();
      done.set_value();
    });
    done.get_future().wait();
  }
  Drain(executor);
  EXPECT_LE(executor.clients(), DeviceExecutor::kMaxClients + 2);
  // Once idle, the executor's virtual time passes every debt: the next task forgets them all.
  executor.Submit("last", [] {});
  Drain(executor);
  EXPECT_LE(executor.clients(), 2);
}

}  // namespace
}  // namespace gradwire::scheduling

namespace gradwire::scheduling {
namespace {

TEST(ExecutorTest, ASharedTaskIsChargedToItsClientsByTheirShares) {
  Log log;
  DeviceExecutor executor("test", {}, log.clock());
  Gate gate;
  gate.Submit(executor);
  // A 10 ms task of "a" that carried "b"'s work too (a batch): b pays 9 ms of it.
  executor.Submit("a", [&] {
    log.Task("shared", 10e-3)();
    executor.ShareCurrentTask({{"a", 1.0}, {"b", 9.0}});
  });
  for (int i = 0; i < 12; ++i) {
    executor.Submit("a", log.Task("a", 1e-3));
    executor.Submit("b", log.Task("b", 1e-3));
  }
  gate.Open();
  Drain(executor);
  const std::vector<std::string> order = log.order();
  ASSERT_EQ(order.size(), 25u);
  EXPECT_EQ(order[0], "shared");
  // "a" owes 1 ms and "b" 9: "a" runs about 8 tasks before "b" gets one.
  int a_before_b = 0;
  while (1 + a_before_b < int(order.size()) && order[size_t(1 + a_before_b)] == "a") ++a_before_b;
  EXPECT_GE(a_before_b, 7);
  EXPECT_LE(a_before_b, 9);
}

// A batch former over an executor held by a gate, so the test decides what waits together.
struct Batches {
  std::mutex mu;
  std::vector<std::vector<std::string>> ran;  // each batch's members' names, in order
  std::vector<std::pair<int64_t, int64_t>> observed;
  BatchFormer::Runner Runner() {
    return [this](std::vector<BatchFormer::Member>& members, BatchFormer::Run&) {
      std::vector<std::string> names;
      for (const auto& m : members) names.push_back(*std::static_pointer_cast<std::string>(m.item));
      std::lock_guard<std::mutex> lock(mu);
      ran.push_back(std::move(names));
    };
  }
  BatchFormer::Observer Observer() {
    return [this](int64_t requests, int64_t rows) {
      std::lock_guard<std::mutex> lock(mu);
      observed.emplace_back(requests, rows);
    };
  }
  BatchFormer::Member Member(const std::string& client, int64_t rows, const std::string& name) {
    return {client, rows, std::make_shared<std::string>(name)};
  }
};

TEST(BatchFormerTest, RequestsWaitingTogetherRunAsBatchesOfBoundedRows) {
  DeviceExecutor executor("test");
  Batches b;
  BatchFormer former(executor, {/*max_rows=*/10, std::chrono::microseconds(0)}, b.Observer());
  Gate gate;
  gate.Submit(executor);
  former.Add("m1", b.Member("x", 4, "r1"), b.Runner());
  former.Add("m1", b.Member("y", 4, "r2"), b.Runner());
  former.Add("m2", b.Member("x", 1, "s1"), b.Runner());    // another key: its own batch
  former.Add("m1", b.Member("z", 3, "r3"), b.Runner());    // 11 rows: does not fit, opens one
  former.Add("m1", b.Member("x", 2, "r4"), b.Runner());    // joins r3's
  former.Add("m1", b.Member("x", 25, "big"), b.Runner());  // larger than a batch: alone
  // Open (still taking requests): m1's latest (r3, r4) and m2's; "big" was full already.
  EXPECT_EQ(former.open(), 2);
  gate.Open();
  Drain(executor);
  std::lock_guard<std::mutex> lock(b.mu);
  std::vector<std::vector<std::string>> sorted = b.ran;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted,
            (std::vector<std::vector<std::string>>{{"big"}, {"r1", "r2"}, {"r3", "r4"}, {"s1"}}));
  std::sort(b.observed.begin(), b.observed.end());
  EXPECT_EQ(b.observed,
            (std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {1, 25}, {2, 5}, {2, 8}}));
  EXPECT_EQ(former.open(), 0);
}

TEST(BatchFormerTest, AStartedBatchTakesNoMoreRequests) {
  DeviceExecutor executor("test");
  Batches b;
  BatchFormer former(executor, {8, std::chrono::microseconds(0)});
  std::promise<void> inside, release;
  std::shared_future<void> released = release.get_future().share();
  former.Add("m", b.Member("x", 1, "first"),
             [&](std::vector<BatchFormer::Member>& members, BatchFormer::Run& run) {
               inside.set_value();
               released.wait();
               b.Runner()(members, run);
             });
  inside.get_future().wait();  // the batch has started
  former.Add("m", b.Member("y", 1, "second"), b.Runner());
  release.set_value();
  Drain(executor);
  std::lock_guard<std::mutex> lock(b.mu);
  EXPECT_EQ(b.ran, (std::vector<std::vector<std::string>>{{"first"}, {"second"}}));
}

TEST(BatchFormerTest, AWaitingBatchGoesWhenOtherWorkArrives) {
  DeviceExecutor executor("test");
  Batches b;
  BatchFormer former(executor, {8, std::chrono::microseconds(60'000'000)});
  const auto start = std::chrono::steady_clock::now();
  former.Add("m", b.Member("c", 1, "alone"), b.Runner());  // starts at once, waits for company
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::promise<void> other;
  executor.Submit("someone else", [&other] { other.set_value(); });
  other.get_future().wait();  // runs after the batch, which stopped waiting for it
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  std::lock_guard<std::mutex> lock(b.mu);
  EXPECT_EQ(b.ran, (std::vector<std::vector<std::string>>{{"alone"}}));
}

TEST(BatchFormerTest, ADelayedBatchRunsOnceFull) {
  DeviceExecutor executor("test");
  Batches b;
  // A delay far longer than the test: the batch must go as soon as it is full, not at the delay.
  BatchFormer former(executor, {3, std::chrono::microseconds(60'000'000)});
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) former.Add("m", b.Member("c", 1, std::to_string(i)), b.Runner());
  Drain(executor);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  std::lock_guard<std::mutex> lock(b.mu);
  ASSERT_EQ(b.ran.size(), 1u);
  EXPECT_EQ(b.ran[0], (std::vector<std::string>{"0", "1", "2"}));
}

// Polls (up to 30 s) until `log`, guarded by `mu`, holds `n` entries: a test whose batches must
// run with no other work queued waits for them this way before it drains the executor.
void WaitForEntries(std::mutex& mu, const std::vector<std::string>& log, size_t n) {
  for (int i = 0; i < 30000; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (log.size() >= n) return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

TEST(BatchFormerTest, ABatchYieldsToAnotherClientsWorkBetweenItsMembers) {
  // The heavy client's five requests wait together; while the batch runs its second, a light
  // client's task arrives. The batch gives its last three back, the light task runs, then they
  // do, as a batch of their own. That batch does not yield again: a second light task that
  // arrives while it runs waits for its end.
  DeviceExecutor executor("test");
  Batches b;
  BatchFormer former(executor, {100, std::chrono::microseconds(0), /*yield=*/true}, b.Observer());
  std::mutex mu;
  std::vector<std::string> order;
  auto record = [&](const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(what);
  };
  BatchFormer::Runner runner = [&](std::vector<BatchFormer::Member>& members,
                                   BatchFormer::Run& run) {
    for (size_t i = 0; i < members.size(); ++i) {
      const std::string name = *std::static_pointer_cast<std::string>(members[i].item);
      record(name);
      if (name == "h1") executor.Submit("light", [&] { record("light"); });
      if (name == "h2") executor.Submit("light", [&] { record("light again"); });
      if (i + 1 < members.size() && run.OthersWaiting()) {
        run.GiveBack(members, i + 1);
        break;
      }
    }
  };
  Gate gate;
  gate.Submit(executor);
  for (int i = 0; i < 5; ++i)
    former.Add("m", b.Member("heavy", 1, "h" + std::to_string(i)), runner);
  gate.Open();
  // No other work may be queued while the batch runs: wait for its end, then drain.
  WaitForEntries(mu, order, 7);
  Drain(executor);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(order,
            (std::vector<std::string>{"h0", "h1", "light", "h2", "h3", "h4", "light again"}));
  std::lock_guard<std::mutex> lock2(b.mu);
  EXPECT_EQ(b.observed, (std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {3, 3}}));
  EXPECT_EQ(former.open(), 0);
}

TEST(BatchFormerTest, GivenBackMembersGoBeforeLaterOnesOfTheirKey) {
  // While the batch runs, a later request of its key opens the next batch; the members given
  // back go to its front, so the order the requests came in holds.
  DeviceExecutor executor("test");
  Batches b;
  BatchFormer former(executor, {100, std::chrono::microseconds(0), /*yield=*/true}, b.Observer());
  std::mutex mu;
  std::vector<std::string> order;
  BatchFormer::Runner runner;
  runner = [&](std::vector<BatchFormer::Member>& members, BatchFormer::Run& run) {
    for (size_t i = 0; i < members.size(); ++i) {
      const std::string name = *std::static_pointer_cast<std::string>(members[i].item);
      {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(name);
      }
      if (name == "a0") {
        former.Add("k", b.Member("a", 1, "a3"), runner);  // opens the next batch of the key
        executor.Submit("other", [] {});
      }
      if (i + 1 < members.size() && run.OthersWaiting()) {
        run.GiveBack(members, i + 1);
        break;
      }
    }
  };
  Gate gate;
  gate.Submit(executor);
  for (int i = 0; i < 3; ++i) former.Add("k", b.Member("a", 1, "a" + std::to_string(i)), runner);
  gate.Open();
  WaitForEntries(mu, order, 4);
  Drain(executor);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(order, (std::vector<std::string>{"a0", "a1", "a2", "a3"}));
  // a0 ran alone; a1 and a2 were given back into a3's batch.
  std::lock_guard<std::mutex> lock2(b.mu);
  EXPECT_EQ(b.observed, (std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 3}}));
}

TEST(BatchFormerTest, WithoutYieldABatchRunsWhole) {
  DeviceExecutor executor("test");
  Batches b;
  BatchFormer former(executor, {100, std::chrono::microseconds(0)}, b.Observer());  // the default
  std::atomic<bool> others{false};
  BatchFormer::Runner runner = [&](std::vector<BatchFormer::Member>& members,
                                   BatchFormer::Run& run) {
    executor.Submit("light", [] {});
    others = run.OthersWaiting();
    b.Runner()(members, run);
  };
  Gate gate;
  gate.Submit(executor);
  for (int i = 0; i < 3; ++i) former.Add("m", b.Member("heavy", 1, std::to_string(i)), runner);
  gate.Open();
  Drain(executor);
  EXPECT_FALSE(others.load());
  std::lock_guard<std::mutex> lock(b.mu);
  EXPECT_EQ(b.ran, (std::vector<std::vector<std::string>>{{"0", "1", "2"}}));
}

}  // namespace
}  // namespace gradwire::scheduling
