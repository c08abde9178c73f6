// TrimHeap against the pattern that made the server's RSS creep under training load: large
// blocks freed between small blocks that stay live, so free() cannot give their pages back.
#include "server/core/heap_trim.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "tests/sanitized.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace gradwire::core {
namespace {

using gradwire::testing::kSanitized;

TEST(HeapTrimTest, ReportsTheProcessRss) {
  const int64_t rss = ProcessRssBytes();
  EXPECT_GT(rss, int64_t(1) << 20);
  const HeapTrimResult r = TrimHeap();
  EXPECT_GT(r.rss_before_bytes, 0);
  EXPECT_GT(r.rss_after_bytes, 0);
  EXPECT_GE(r.seconds, 0.0);
}

TEST(HeapTrimTest, ReturnsHolesBetweenLiveBlocksToTheOs) {
  if (kSanitized) GTEST_SKIP() << "RSS is not meaningful under a sanitizer allocator";
  if (!TrimHeap().supported) GTEST_SKIP() << "no malloc_trim in this C library";
#if defined(__GLIBC__)
  // Earlier tests leave free chunks the small blocks below may reuse, so the large ones can end up
  // next to each other at the top of the heap, where free() itself would trim them. A trim
  // threshold free() never reaches makes "freed but kept" hold whatever the heap looked like.
  ASSERT_EQ(mallopt(M_TRIM_THRESHOLD, 1 << 30), 1);
  struct RestoreTrimThreshold {
    ~RestoreTrimThreshold() { mallopt(M_TRIM_THRESHOLD, 128 << 10); }  // glibc's default
  } restore;
#endif
  // 512 blocks of 64 KiB (below glibc's mmap threshold: they come from the heap), each followed
  // by a small block that stays live, like a consumed-context id allocated between two weight
  // workspaces.
  constexpr size_t kBlocks = 512, kBig = size_t(64) << 10, kSmall = 64;
  constexpr int64_t kTotal = int64_t(kBlocks * kBig);  // 32 MiB
  std::mt19937 rng(std::random_device{}());
  std::vector<unsigned char*> big, small;
  const int64_t rss_start = ProcessRssBytes();
  unsigned sum = 0;
  for (size_t i = 0; i < kBlocks; ++i) {
    big.push_back(static_cast<unsigned char*>(std::malloc(kBig)));
    small.push_back(static_cast<unsigned char*>(std::malloc(kSmall)));
    ASSERT_NE(big.back(), nullptr);
    ASSERT_NE(small.back(), nullptr);
    std::memset(big.back(), int(rng() & 0xFF) | 1, kBig);  // make every page resident
    std::memset(small.back(), int(rng() & 0xFF), kSmall);
  }
  for (unsigned char* p : big) sum += p[rng() % kBig];
  const int64_t rss_full = ProcessRssBytes();
  for (unsigned char* p : big) std::free(p);
  const int64_t rss_freed = ProcessRssBytes();
  // The precondition of the check below: free() alone kept (nearly all of) the holes resident.
  ASSERT_GE(rss_full - rss_start, kTotal * 3 / 4) << "the blocks were not resident";
  ASSERT_GE(rss_freed - rss_start, kTotal / 2) << "free() returned the holes by itself";

  const HeapTrimResult r = TrimHeap();
  EXPECT_GE(r.rss_before_bytes, rss_freed - (int64_t(1) << 20));
  // Each hole is 16 pages; all but its partial edge pages go back.
  EXPECT_LE(r.rss_after_bytes, rss_freed - kTotal / 2)
      << "RSS " << (rss_freed >> 10) << " KiB before the trim, " << (r.rss_after_bytes >> 10)
      << " KiB after";
  for (unsigned char* p : small) sum += p[0];
  for (unsigned char* p : small) std::free(p);
  volatile unsigned sink = sum;  // keeps the stores observable
  (void)sink;
}

}  // namespace
}  // namespace gradwire::core
