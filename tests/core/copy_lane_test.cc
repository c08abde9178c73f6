// CopyLane on a model of a device's two queues, compute and copy. Each queue runs its work only
// when something forces it (a host wait, a wait of the other queue, the test's final drain), and
// the test drains the queues in both orders: work the lane left unordered then runs in the order
// that breaks it, and shows as wrong bytes. A pageable copy to the device takes the host's bytes
// when it is queued (as a driver's staging does) and crosses when its queue runs.
#include "server/device/copy_lane.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
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

using Bytes = std::vector<unsigned char>;

Bytes Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

// Knobs for TwoQueues::Ops that break one ordering each, to show the model catches its absence.
struct QueueBreaks {
  bool compute_waits = false;  // the compute queue does not wait for crossings
  bool copy_waits = false;     // the copy queue does not wait for compute
  bool no_memory = false;      // a landing cannot be allocated
  int fail_crossing = 0;       // this pageable crossing (1-based) throws, as a CUDA error would
};

class TwoQueues {
 public:
  enum Q { kCompute = 0, kCopy = 1 };

  using Breaks = QueueBreaks;
  // What the lane is given.
  LaneOps Ops(Breaks breaks = Breaks()) {
    LaneOps ops;
    ops.to_device = [this, breaks, calls = std::make_shared<int>(0)](void* d, const void* h,
                                                                     size_t n) {
      if (++*calls == breaks.fail_crossing) throw std::runtime_error("simulated CUDA error");
      auto taken = std::make_shared<Bytes>(static_cast<const unsigned char*>(h),
                                           static_cast<const unsigned char*>(h) + n);
      Enqueue(kCopy, [d, taken] { std::memcpy(d, taken->data(), taken->size()); });
    };
    ops.to_host = [this](void* h, const void* d, size_t n) {
      Enqueue(kCopy, [h, d, n] { std::memcpy(h, d, n); });
      RunUntil(kCopy, enqueued_[kCopy]);
    };
    ops.device_copy = [this](void* dst, const void* src, size_t n) {
      Enqueue(kCompute, [dst, src, n] { std::memcpy(dst, src, n); });
    };
    ops.record_compute = [this](int e) { marks_[e] = {kCompute, enqueued_[kCompute]}; };
    ops.record_copy = [this](int e) { marks_[e] = {kCopy, enqueued_[kCopy]}; };
    ops.compute_waits = [this, breaks](int e) {
      if (!breaks.compute_waits) Wait(kCompute, e);
    };
    ops.copy_waits = [this, breaks](int e) {
      if (!breaks.copy_waits) Wait(kCopy, e);
    };
    ops.alloc = [this, breaks](size_t n) {
      if (breaks.no_memory) throw std::runtime_error("simulated out of device memory");
      return Alloc(n);
    };
    ops.release = [this](void* p) { Release(p); };
    return ops;
  }
  // Pinned slots' operations for a StagedCopier on the copy queue (events 100 + slot).
  StagingOps Staging() {
    StagingOps ops;
    ops.to_device = [this](void* d, const void* p, size_t n) {
      Enqueue(kCopy, [d, p, n] { std::memcpy(d, p, n); });
    };
    ops.to_host = [this](void* p, const void* d, size_t n) {
      Enqueue(kCopy, [d, p, n] { std::memcpy(p, d, n); });
    };
    ops.record = [this](int slot) { marks_[100 + slot] = {kCopy, enqueued_[kCopy]}; };
    ops.wait = [this](int slot) {
      auto it = marks_.find(100 + slot);
      if (it != marks_.end()) RunUntil(kCopy, it->second.second);
    };
    return ops;
  }

  // The compute allocator: a freed block goes back at once and is handed out again (the most
  // recently freed first) for work ordered after the free on the compute queue; the free itself
  // is a write of garbage queued there, as the next owner's kernels would be.
  void* Alloc(size_t n) {
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if ((*it)->size() >= n) {
        void* p = (*it)->data();
        live_.push_back(*it);
        free_.erase(std::next(it).base());
        return p;
      }
    }
    live_.push_back(std::make_shared<Bytes>(n, 0));
    return live_.back()->data();
  }
  void Release(void* p) {
    for (auto it = live_.begin(); it != live_.end(); ++it) {
      if ((*it)->data() == p) {
        std::shared_ptr<Bytes> b = *it;
        live_.erase(it);
        Enqueue(kCompute, [b] { std::fill(b->begin(), b->end(), 0x5A); });
        free_.push_back(b);
        return;
      }
    }
    ADD_FAILURE() << "released a block that is not live";
  }

  // Kernels: a compute read of device bytes into `out`, a compute write of `bytes`.
  void ComputeRead(const void* src, size_t n, Bytes* out) {
    Enqueue(kCompute, [src, n, out] {
      out->assign(static_cast<const unsigned char*>(src),
                  static_cast<const unsigned char*>(src) + n);
    });
  }
  void ComputeWrite(void* dst, Bytes bytes) {
    Enqueue(kCompute, [dst, b = std::move(bytes)] { std::memcpy(dst, b.data(), b.size()); });
  }

  void Drain(bool copy_first) {
    const Q a = copy_first ? kCopy : kCompute, b = copy_first ? kCompute : kCopy;
    RunUntil(a, enqueued_[a]);
    RunUntil(b, enqueued_[b]);
  }
  int64_t done(Q q) const { return done_[q]; }
  int64_t pending(Q q) const { return enqueued_[q] - done_[q]; }

 private:
  struct Op {
    std::function<void()> run;
    int wait_q = -1;  // run the other queue up to wait_seq first
    int64_t wait_seq = 0;
  };
  void Enqueue(Q q, std::function<void()> f) {
    queues_[q].push_back({std::move(f)});
    ++enqueued_[q];
  }
  void Wait(Q q, int e) {
    auto it = marks_.find(e);
    if (it == marks_.end()) return;  // never recorded: nothing to wait for
    queues_[q].push_back({nullptr, it->second.first, it->second.second});
    ++enqueued_[q];
  }
  void RunUntil(int q, int64_t seq) {
    while (done_[q] < seq) {
      Op op = queues_[q].front();
      if (op.wait_q >= 0) RunUntil(op.wait_q, op.wait_seq);
      queues_[q].pop_front();
      ++done_[q];
      if (op.run) op.run();
    }
  }

  std::array<std::deque<Op>, 2> queues_;
  std::array<int64_t, 2> enqueued_{0, 0}, done_{0, 0};
  std::map<int, std::pair<Q, int64_t>> marks_;
  std::vector<std::shared_ptr<Bytes>> live_, free_;
};

struct Rig {
  // staged_chunk 0: plain copies; else two pinned slots of that size for crossings of at least
  // 2 chunks.
  Rig(size_t staged_chunk, size_t landing_max, QueueBreaks breaks = QueueBreaks())
      : slots(2, Bytes(std::max<size_t>(1, staged_chunk))) {
    if (staged_chunk > 0) {
      copier = std::make_unique<StagedCopier>(
          std::vector<void*>{slots[0].data(), slots[1].data()}, staged_chunk, q.Staging(),
          [](void* d, const void* s, size_t n) { std::memcpy(d, s, n); });
    }
    lane = std::make_unique<CopyLane>(q.Ops(breaks), copier.get(), 2 * staged_chunk, landing_max,
                                      /*landing_grain=*/1);
  }
  TwoQueues q;
  std::vector<Bytes> slots;
  std::unique_ptr<StagedCopier> copier;
  std::unique_ptr<CopyLane> lane;
};

// Uploads of every size back to back, each read by a compute kernel queued after it, the host's
// bytes overwritten as soon as the upload returns, the destination freed right after its read
// (the allocator hands it out again): every read sees its own bytes, whatever order the queues
// drain in, with the landing ring, past the largest landing (straight in), and through the pinned
// slots.
TEST(CopyLane, EveryUploadReachesTheComputeThatReadsIt) {
  const std::vector<size_t> sizes = {0, 1, 63, 64, 65, 200, 1000, 3000, 7, 1000, 129, 3000, 2};
  for (size_t chunk : {size_t(0), size_t(64)}) {
    for (size_t landing_max : {size_t(1) << 20, size_t(500)}) {
      for (bool copy_first : {true, false}) {
        SCOPED_TRACE(testing::Message() << "chunk " << chunk << ", landing max " << landing_max
                                        << (copy_first ? ", copy queue drained first" : ""));
        Rig rig(chunk, landing_max);
        std::vector<Bytes> sent, read(sizes.size());
        for (size_t i = 0; i < sizes.size(); ++i) {
          sent.push_back(Random(sizes[i], uint32_t(i + 1)));
          Bytes host = sent.back();
          void* dst = rig.q.Alloc(std::max<size_t>(1, sizes[i]));
          rig.lane->Upload(dst, host.data(), host.size());
          std::fill(host.begin(), host.end(), 0xEE);  // the caller reuses its bytes
          rig.q.ComputeRead(dst, sizes[i], &read[i]);
          rig.q.Release(dst);
        }
        rig.q.Drain(copy_first);
        for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(read[i], sent[i]) << "upload " << i;
      }
    }
  }
}

// A download returns the bytes the compute work queued before it wrote, with the compute queue
// not yet run, through plain copies and through the pinned slots.
TEST(CopyLane, ADownloadWaitsForTheComputeThatWroteItsSource) {
  for (size_t chunk : {size_t(0), size_t(64)}) {
    for (size_t n : {size_t(1), size_t(100), size_t(1000)}) {
      SCOPED_TRACE(testing::Message() << "chunk " << chunk << ", " << n << " bytes");
      Rig rig(chunk, 1 << 20);
      void* src = rig.q.Alloc(n);
      const Bytes first = Random(n, 1), second = Random(n, 2);
      rig.q.ComputeWrite(src, first);
      rig.q.ComputeWrite(src, second);
      Bytes back(n, 0);
      rig.lane->Download(back.data(), src, n);
      EXPECT_EQ(back, second);
    }
  }
}

// The point of the lane: once its landing is there, an upload crosses without running the
// compute work queued before it (the previous call's), even when the host waits for the pinned
// slots; only a crossing past the largest landing waits for it. That contrast is what shows the
// count can see a wait.
TEST(CopyLane, AnUploadDoesNotWaitForEarlierComputeWork) {
  constexpr size_t kN = 1000;
  for (size_t chunk : {size_t(0), size_t(64)}) {
    for (bool landed : {true, false}) {
      SCOPED_TRACE(testing::Message() << "chunk " << chunk << (landed ? "" : ", no landing"));
      Rig rig(chunk, landed ? 1 << 20 : kN - 1);
      const Bytes warm = Random(kN, 7);
      void* dst = rig.q.Alloc(kN);
      for (int i = 0; i < CopyLane::kLandings; ++i) {
        rig.lane->Upload(dst, warm.data(), kN);  // each landing is made (and waits once)
      }
      rig.q.Drain(true);
      void* scratch = rig.q.Alloc(kN);
      for (int i = 0; i < 5; ++i) rig.q.ComputeWrite(scratch, Random(kN, uint32_t(10 + i)));
      const int64_t before = rig.q.done(TwoQueues::kCompute);
      const int64_t copied = rig.q.done(TwoQueues::kCopy);
      const Bytes sent = Random(kN, 8);
      rig.lane->Upload(dst, sent.data(), kN);
      Bytes read;
      rig.q.ComputeRead(dst, kN, &read);
      if (chunk > 0 && !landed) {
        EXPECT_GT(rig.q.done(TwoQueues::kCompute), before) << "a straight crossing waits";
      } else {
        EXPECT_EQ(rig.q.done(TwoQueues::kCompute), before) << "the upload ran compute work";
      }
      if (landed && chunk > 0) {
        EXPECT_GT(rig.q.done(TwoQueues::kCopy), copied) << "the host waited for no pinned slot";
      }
      rig.q.Drain(false);
      EXPECT_EQ(read, sent);
    }
  }
}

// A landing is a block from the compute allocator, which may hand out a block that compute work
// queued before its free still reads: the first crossing into it waits for that work.
TEST(CopyLane, ANewLandingWaitsForComputeStillReadingItsBlock) {
  for (size_t chunk : {size_t(0), size_t(64)}) {
    SCOPED_TRACE(testing::Message() << "chunk " << chunk);
    Rig rig(chunk, 1 << 20);
    constexpr size_t kN = 512;
    void* dst = rig.q.Alloc(kN);
    void* block = rig.q.Alloc(kN);
    const Bytes before = Random(kN, 3);
    rig.q.ComputeWrite(block, before);
    Bytes read;
    rig.q.ComputeRead(block, kN, &read);
    rig.q.Release(block);  // freed with its read still queued: the lane's landing gets it
    const Bytes sent = Random(kN, 4);
    rig.lane->Upload(dst, sent.data(), kN);
    EXPECT_EQ(rig.lane->landing_bytes(), kN);
    Bytes got;
    rig.q.ComputeRead(dst, kN, &got);
    rig.q.Drain(true);
    EXPECT_EQ(read, before) << "the crossing overwrote a block compute was still reading";
    EXPECT_EQ(got, sent);
  }
}

// The model has teeth: without the compute queue's wait, a kernel reads its input before it
// crossed; without the copy queue's, a crossing overwrites a landing before compute copied the
// previous upload out of it, and a download reads its source before compute wrote it.
TEST(CopyLane, TheModelCatchesEachMissingWait) {
  const Bytes a = Random(300, 1), b = Random(300, 2), c = Random(300, 3);
  {
    TwoQueues::Breaks breaks;
    breaks.compute_waits = true;
    Rig rig(0, 1 << 20, breaks);
    void* dst = rig.q.Alloc(a.size());
    rig.lane->Upload(dst, a.data(), a.size());
    Bytes read;
    rig.q.ComputeRead(dst, a.size(), &read);
    rig.q.Drain(/*copy_first=*/false);
    EXPECT_NE(read, a) << "compute read its input before it crossed";
  }
  {
    TwoQueues::Breaks breaks;
    breaks.copy_waits = true;
    Rig rig(0, 1 << 20, breaks);
    std::vector<Bytes> read(3);
    const std::vector<const Bytes*> sent = {&a, &b, &c};
    for (size_t i = 0; i < 3; ++i) {
      void* dst = rig.q.Alloc(a.size());
      rig.lane->Upload(dst, sent[i]->data(), a.size());
      rig.q.ComputeRead(dst, a.size(), &read[i]);
    }
    rig.q.Drain(/*copy_first=*/true);
    EXPECT_NE(read[0], a) << "the third upload's crossing overwrote the first's landing";
  }
  {
    TwoQueues::Breaks breaks;
    breaks.copy_waits = true;
    Rig rig(0, 1 << 20, breaks);
    void* src = rig.q.Alloc(a.size());
    rig.q.ComputeWrite(src, a);
    Bytes back(a.size(), 0);
    rig.lane->Download(back.data(), src, a.size());
    EXPECT_NE(back, a) << "the download read its source before compute wrote it";
  }
}

// Without the memory for a landing, an upload crosses straight into its tensor after the compute
// work queued before it (which may still read that block), and is right.
TEST(CopyLane, AnUploadWithoutALandingCrossesStraight) {
  for (size_t chunk : {size_t(0), size_t(64)}) {
    SCOPED_TRACE(testing::Message() << "chunk " << chunk);
    QueueBreaks breaks;
    breaks.no_memory = true;
    Rig rig(chunk, 1 << 20, breaks);
    constexpr size_t kN = 700;
    void* block = rig.q.Alloc(kN);
    const Bytes before = Random(kN, 5);
    rig.q.ComputeWrite(block, before);
    Bytes read;
    rig.q.ComputeRead(block, kN, &read);
    rig.q.Release(block);
    void* dst = rig.q.Alloc(kN);  // the block compute still reads
    const Bytes sent = Random(kN, 6);
    rig.lane->Upload(dst, sent.data(), kN);
    EXPECT_EQ(rig.lane->landing_bytes(), 0u);
    Bytes got;
    rig.q.ComputeRead(dst, kN, &got);
    rig.q.Drain(true);
    EXPECT_EQ(read, before);
    EXPECT_EQ(got, sent);
  }
}

// A crossing that fails (a CUDA error) fails its upload and leaves the lane usable: the next
// uploads into the same landing and straight arrive.
TEST(CopyLane, AFailedCrossingLeavesTheLaneUsable) {
  for (size_t landing_max : {size_t(1) << 20, size_t(100)}) {
    SCOPED_TRACE(testing::Message() << "landing max " << landing_max);
    QueueBreaks breaks;
    breaks.fail_crossing = 2;
    Rig rig(0, landing_max, breaks);
    const std::vector<Bytes> sent = {Random(300, 1), Random(300, 2), Random(300, 3),
                                     Random(300, 4)};
    std::vector<Bytes> read(sent.size());
    for (size_t i = 0; i < sent.size(); ++i) {
      void* dst = rig.q.Alloc(300);
      if (i == 1) {
        EXPECT_THROW(rig.lane->Upload(dst, sent[i].data(), 300), std::runtime_error);
        continue;
      }
      rig.lane->Upload(dst, sent[i].data(), 300);
      rig.q.ComputeRead(dst, 300, &read[i]);
    }
    rig.q.Drain(true);
    for (size_t i : {size_t(0), size_t(2), size_t(3)}) EXPECT_EQ(read[i], sent[i]) << i;
  }
}

TEST(CopyLane, NeedsEveryOperation) {
  TwoQueues q;
  LaneOps ops = q.Ops();
  ops.device_copy = nullptr;
  EXPECT_THROW(CopyLane(ops, nullptr, 0, 1), std::invalid_argument);
}

}  // namespace
}  // namespace gradwire::device
