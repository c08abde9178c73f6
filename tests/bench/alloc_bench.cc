// The cost of fresh memory: a large block malloc'ed, filled with memcpy (what a receive buffer or
// a decoded tensor gets) and freed, again and again, against memcpy into a block that stays.
// scripts/bench-alloc.sh runs it under each allocator (LD_PRELOAD) and tuned glibc, side by side.
// Prints one JSON line per size: {"mib", "fresh_ms", "warm_ms", "rss_mib_after"}.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

long RssKib() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0, rss = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%ld %ld", &pages, &rss) != 2) rss = 0;
    std::fclose(f);
  }
  return rss * 4;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  for (size_t mib : {1, 4, 16, 64, 256}) {
    const size_t bytes = mib << 20;
    std::vector<char> src(bytes, 1);
    const int n = mib >= 256 ? reps / 4 + 1 : reps;
    // Fresh: a new block per use, as a receive slice or a temporary tensor is.
    double t0 = Now();
    for (int i = 0; i < n; ++i) {
      char* p = static_cast<char*>(std::malloc(bytes));
      std::memcpy(p, src.data(), bytes);
      asm volatile("" : : "r"(p) : "memory");
      std::free(p);
    }
    const double fresh = (Now() - t0) / n * 1e3;
    // Warm: the same block every time.
    char* keep = static_cast<char*>(std::malloc(bytes));
    std::memcpy(keep, src.data(), bytes);
    t0 = Now();
    for (int i = 0; i < n; ++i) {
      std::memcpy(keep, src.data(), bytes);
      asm volatile("" : : "r"(keep) : "memory");
    }
    const double warm = (Now() - t0) / n * 1e3;
    std::free(keep);
    std::printf("{\"mib\": %zu, \"fresh_ms\": %.3f, \"warm_ms\": %.3f, \"rss_mib_after\": %.1f}\n",
                mib, fresh, warm, RssKib() / 1024.0);
  }
  return 0;
}
