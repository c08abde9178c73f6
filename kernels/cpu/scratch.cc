#include "gradwire/kernels/cpu/scratch.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace gradwire::kernels::cpu {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kHugeMin = size_t(4) << 20;

struct Pool {
  std::mutex mu;
  std::vector<std::pair<void*, size_t>> free;  // buffer, capacity
  size_t free_bytes = 0;
  size_t leased_bytes = 0;
  int64_t allocations = 0;
};

Pool& GetPool() {
  static Pool* pool = new Pool();  // never destroyed: leases may end during static destruction
  return *pool;
}

void Give(void* data, size_t capacity) {
  Pool& pool = GetPool();
  std::vector<void*> drop;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    pool.leased_bytes -= capacity;
    pool.free.emplace_back(data, capacity);
    pool.free_bytes += capacity;
    // Over the bound: drop the smallest buffers first (the large ones are the costly ones to
    // fault in again).
    std::sort(pool.free.begin(), pool.free.end(),
              [](const auto& a, const auto& b) { return a.second > b.second; });
    while (pool.free_bytes > kScratchKeepBytes && !pool.free.empty()) {
      drop.push_back(pool.free.back().first);
      pool.free_bytes -= pool.free.back().second;
      pool.free.pop_back();
    }
  }
  for (void* p : drop) FreeHostBuffer(p);
}

}  // namespace

void* AllocateHostBuffer(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes >= kHugeMin) {
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = std::aligned_alloc(kHugePage, rounded);
    if (p != nullptr) (void)madvise(p, rounded, MADV_HUGEPAGE);  // advice: failure is harmless
    return p;
  }
  return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
}

void FreeHostBuffer(void* p) { std::free(p); }

Scratch::~Scratch() {
  if (data_ != nullptr) Give(data_, capacity_);
}

Scratch::Scratch(Scratch&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      capacity_(std::exchange(other.capacity_, 0)) {}

Scratch& Scratch::operator=(Scratch&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) Give(data_, capacity_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

Scratch TakeScratch(size_t bytes) {
  Pool& pool = GetPool();
  Scratch s;
  s.bytes_ = bytes;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    // The smallest free buffer that fits, unless it is more than twice what is asked (a small
    // lease must not pin a large buffer that a large call will want).
    size_t best = pool.free.size();
    for (size_t i = 0; i < pool.free.size(); ++i) {
      const size_t cap = pool.free[i].second;
      if (cap >= bytes && cap <= 2 * bytes + 4096 &&
          (best == pool.free.size() || cap < pool.free[best].second)) {
        best = i;
      }
    }
    if (best < pool.free.size()) {
      s.data_ = pool.free[best].first;
      s.capacity_ = pool.free[best].second;
      pool.free.erase(pool.free.begin() + std::ptrdiff_t(best));
      pool.free_bytes -= s.capacity_;
      pool.leased_bytes += s.capacity_;
      return s;
    }
    pool.leased_bytes += bytes;
    ++pool.allocations;
  }
  s.capacity_ = bytes;
  s.data_ = AllocateHostBuffer(bytes);
  if (s.data_ == nullptr) {
    std::lock_guard<std::mutex> lock(GetPool().mu);
    GetPool().leased_bytes -= bytes;
    s.capacity_ = 0;
    throw std::bad_alloc();
  }
  return s;
}

void ReleaseScratch() {
  Pool& pool = GetPool();
  std::vector<std::pair<void*, size_t>> drop;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    drop.swap(pool.free);
    pool.free_bytes = 0;
  }
  for (const auto& [p, cap] : drop) FreeHostBuffer(p);
}

ScratchStats GetScratchStats() {
  Pool& pool = GetPool();
  std::lock_guard<std::mutex> lock(pool.mu);
  return {int64_t(pool.free_bytes), int64_t(pool.leased_bytes), pool.allocations};
}

}  // namespace gradwire::kernels::cpu
