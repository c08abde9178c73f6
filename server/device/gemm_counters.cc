#include "server/device/gemm_counters.h"

#include <atomic>

namespace gradwire::device {
namespace {

std::atomic<double> g_gemm_flops{0};
std::atomic<double> g_gemm_seconds{0};

void Add(std::atomic<double>& counter, double value) {
  double seen = counter.load(std::memory_order_relaxed);
  while (!counter.compare_exchange_weak(seen, seen + value, std::memory_order_relaxed)) {
  }
}

}  // namespace

GemmCounters GemmTotals() { return {g_gemm_flops.load(), g_gemm_seconds.load()}; }

void CountGemm(double flops, double seconds) {
  Add(g_gemm_flops, flops);
  Add(g_gemm_seconds, seconds);
}

}  // namespace gradwire::device
