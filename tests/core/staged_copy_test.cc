// StagedCopier's pipeline on a simulated asynchronous stream: queued copies run only when a wait
// (or the test's final sync) reaches them, as on a GPU stream, so a slot refilled before its
// crossing ran, or read before its crossing arrived, shows as wrong bytes.
#include "server/device/staged_copy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

namespace gradwire::device {
namespace {

class FakeStream {
 public:
  StagingOps Ops(bool honour_waits = true) {
    StagingOps ops;
    ops.to_device = [this](void* dst, const void* src, size_t n) { Enqueue(dst, src, n); };
    ops.to_host = [this](void* dst, const void* src, size_t n) { Enqueue(dst, src, n); };
    ops.record = [this](int slot) { marks_[slot] = enqueued_; };
    ops.wait = [this, honour_waits](int slot) {
      auto it = marks_.find(slot);
      if (honour_waits && it != marks_.end()) RunUntil(it->second);
    };
    return ops;
  }
  void Sync() { RunUntil(enqueued_); }
  int64_t pending() const { return enqueued_ - done_; }

 private:
  void Enqueue(void* dst, const void* src, size_t n) {
    queue_.push_back([dst, src, n] { std::memcpy(dst, src, n); });
    ++enqueued_;
  }
  void RunUntil(int64_t seq) {
    while (done_ < seq) {
      queue_.front()();
      queue_.pop_front();
      ++done_;
    }
  }
  std::deque<std::function<void()>> queue_;
  std::map<int, int64_t> marks_;
  int64_t enqueued_ = 0, done_ = 0;
};

std::vector<unsigned char> Bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

struct Rig {
  explicit Rig(int slots, size_t chunk, bool honour_waits = true)
      : buffers(size_t(slots), std::vector<unsigned char>(chunk)) {
    std::vector<void*> p;
    for (auto& b : buffers) p.push_back(b.data());
    copier = std::make_unique<StagedCopier>(p, chunk, stream.Ops(honour_waits));
  }
  FakeStream stream;
  std::vector<std::vector<unsigned char>> buffers;
  std::unique_ptr<StagedCopier> copier;
};

TEST(StagedCopy, EverySizeArrivesBothWays) {
  constexpr size_t kChunk = 64;
  for (int slots : {2, 3, 4}) {
    for (size_t n : {size_t(0), size_t(1), size_t(7), kChunk - 1, kChunk, kChunk + 1, 3 * kChunk,
                     5 * kChunk + 29, 17 * kChunk}) {
      SCOPED_TRACE(testing::Message() << slots << " slots, " << n << " bytes");
      Rig rig(slots, kChunk);
      const auto host = Bytes(n, uint32_t(n + 1));
      std::vector<unsigned char> device(n, 0xAB), back(n, 0xCD);
      auto sent = host;
      rig.copier->ToDevice(device.data(), sent.data(), n);
      // The caller may free its bytes once ToDevice returns: what crosses later must not read
      // them.
      std::fill(sent.begin(), sent.end(), 0xEE);
      rig.stream.Sync();  // what the device's next use of the tensor waits for
      EXPECT_EQ(device, host);
      const auto other = Bytes(n, uint32_t(n + 2));
      device = other;  // (not memcpy: an empty vector's data() may be null)
      rig.copier->ToHost(back.data(), device.data(), n);
      EXPECT_EQ(rig.stream.pending(), 0) << "ToHost returned with copies still queued";
      EXPECT_EQ(back, other);
    }
  }
}

// Calls back to back without a sync: the second call refills slots whose crossings the first
// call left queued, and a ToHost follows them.
TEST(StagedCopy, CallsBackToBackKeepEachOthersBytes) {
  constexpr size_t kChunk = 32;
  Rig rig(2, kChunk);
  const auto a = Bytes(5 * kChunk + 3, 1), b = Bytes(3 * kChunk + 11, 2);
  std::vector<unsigned char> da(a.size()), db(b.size()), back(b.size());
  rig.copier->ToDevice(da.data(), a.data(), a.size());
  EXPECT_GT(rig.stream.pending(), 0) << "the last crossings may stay queued";
  rig.copier->ToDevice(db.data(), b.data(), b.size());
  rig.copier->ToHost(back.data(), db.data(), db.size());
  rig.stream.Sync();
  EXPECT_EQ(da, a);
  EXPECT_EQ(db, b);
  EXPECT_EQ(back, b);
}

// The simulated stream has teeth: without the waits, a slot is refilled before its crossing ran
// (to the device) or read before its crossing arrived (back), and the bytes come out wrong.
TEST(StagedCopy, TheFakeStreamCatchesAMissingWaitBothWays) {
  constexpr size_t kChunk = 16;
  const auto sent = Bytes(8 * kChunk, 3);
  std::vector<unsigned char> received(sent.size());
  Rig to_device(2, kChunk, /*honour_waits=*/false);
  to_device.copier->ToDevice(received.data(), sent.data(), sent.size());
  to_device.stream.Sync();
  EXPECT_NE(received, sent) << "to the device";
  std::fill(received.begin(), received.end(), 0);
  Rig to_host(2, kChunk, /*honour_waits=*/false);
  to_host.copier->ToHost(received.data(), sent.data(), sent.size());
  EXPECT_NE(received, sent) << "back to the host";
}

// An operation that throws mid-pipeline (a CUDA error) leaves the copier usable: the next call
// moves its bytes.
TEST(StagedCopy, AFailedCopyLeavesTheCopierUsable) {
  constexpr size_t kChunk = 16;
  std::vector<std::vector<unsigned char>> buffers(2, std::vector<unsigned char>(kChunk));
  FakeStream stream;
  StagingOps ops = stream.Ops();
  int calls = 0;
  const auto to_device = ops.to_device;
  ops.to_device = [&](void* d, const void* p, size_t n) {
    if (++calls == 3) throw std::runtime_error("simulated CUDA error");
    to_device(d, p, n);
  };
  StagedCopier copier({buffers[0].data(), buffers[1].data()}, kChunk, ops);
  const auto host = Bytes(6 * kChunk, 5);
  std::vector<unsigned char> device(host.size());
  EXPECT_THROW(copier.ToDevice(device.data(), host.data(), host.size()), std::runtime_error);
  copier.ToDevice(device.data(), host.data(), host.size());
  stream.Sync();
  EXPECT_EQ(device, host);
}

TEST(StagedCopy, NeedsTwoSlots) {
  std::vector<unsigned char> one(8);
  FakeStream stream;
  EXPECT_THROW(StagedCopier({one.data()}, 8, stream.Ops()), std::invalid_argument);
  EXPECT_THROW(StagedCopier({one.data(), one.data()}, 0, stream.Ops()), std::invalid_argument);
}

TEST(StagedCopy, ParallelMemcpyCopiesLargeAndSmall) {
  for (size_t n : {size_t(0), size_t(3), size_t(5) << 20}) {
    const auto src = Bytes(n, 9);
    std::vector<unsigned char> dst(n, 0);
    ParallelMemcpy(dst.data(), src.data(), n);
    EXPECT_EQ(dst, src) << n;
  }
}

}  // namespace
}  // namespace gradwire::device
