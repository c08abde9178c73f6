// The shared-memory regions one Client passes its large tensors through (ClientOptions::
// shared_memory): made on first need (SharedRegion::Create), each lent to one call at a time,
// grown when a call needs more, dropped when the server closed them. A server that cannot give
// this client a region it can open turns the pool off for the client's life: the wire from then
// on, without an error. A refusal that may pass (the server's limits, a failed call) sends calls
// over the wire for a few seconds before the next try.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gradwire/client/shared_memory.h"

namespace gradwire::client {
class Client;
}

namespace gradwire::client::internal {

class SharedMemoryPool {
 public:
  // At most this many regions per client: more concurrent calls than that use the wire.
  static constexpr size_t kMaxRegions = 8;
  // Regions start at this size and grow in powers of two.
  static constexpr uint64_t kMinRegionBytes = uint64_t(1) << 20;

  SharedMemoryPool(Client& client, bool enabled) : client_(client), off_(!enabled) {}
  ~SharedMemoryPool();  // unregisters every region it holds
  SharedMemoryPool(const SharedMemoryPool&) = delete;
  SharedMemoryPool& operator=(const SharedMemoryPool&) = delete;

  // One call's use of a region; back to the pool when it goes, unless dropped.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept : pool_(o.pool_), region_(std::move(o.region_)) { o.pool_ = nullptr; }
    Lease& operator=(Lease&&) = delete;
    ~Lease();
    explicit operator bool() const { return region_ != nullptr; }
    SharedRegion& region() { return *region_; }
    // The server no longer has the region (it closed it unused): discard it.
    void Drop();

   private:
    friend class SharedMemoryPool;
    Lease(SharedMemoryPool* pool, std::unique_ptr<SharedRegion> region)
        : pool_(pool), region_(std::move(region)) {}
    SharedMemoryPool* pool_ = nullptr;
    std::unique_ptr<SharedRegion> region_;
  };

  // A region of at least `bytes` bytes for one call, or an empty lease: the wire.
  Lease Acquire(uint64_t bytes);
  // Whether the pool is off for good (tests).
  bool off() const;
  // Regions made so far (tests).
  int64_t regions_made() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Idle {
    std::unique_ptr<SharedRegion> region;
    Clock::time_point since;
  };
  void Return(std::unique_ptr<SharedRegion> region);

  Client& client_;
  mutable std::mutex mu_;
  bool off_;
  Clock::time_point retry_after_{};
  std::vector<Idle> idle_;
  size_t lent_ = 0;
  int64_t made_ = 0;
};

}  // namespace gradwire::client::internal
