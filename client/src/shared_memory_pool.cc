#include "shared_memory_pool.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "gradwire/client/client.h"

namespace gradwire::client::internal {
namespace {

// A refusal that holds for this client whatever it asks: another host, --shared-memory off, an
// object it cannot open, a server that predates CreateSharedMemory.
bool Lasting(absl::StatusCode code) {
  return code == absl::StatusCode::kFailedPrecondition ||
         code == absl::StatusCode::kUnimplemented || code == absl::StatusCode::kPermissionDenied;
}

uint64_t PowerOfTwoAtLeast(uint64_t n) {
  uint64_t p = 1;
  while (p < n && p < (uint64_t(1) << 62)) p <<= 1;
  return p;
}

}  // namespace

SharedMemoryPool::~SharedMemoryPool() {
  std::vector<Idle> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle.swap(idle_);
  }
  // Each region unregisters itself as it goes.
}

SharedMemoryPool::Lease::~Lease() {
  if (pool_ != nullptr && region_ != nullptr) pool_->Return(std::move(region_));
}

void SharedMemoryPool::Lease::Drop() {
  if (pool_ == nullptr || region_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(pool_->mu_);
    --pool_->lent_;
  }
  region_.reset();
  pool_ = nullptr;
}

void SharedMemoryPool::Return(std::unique_ptr<SharedRegion> region) {
  std::lock_guard<std::mutex> lock(mu_);
  --lent_;
  idle_.push_back({std::move(region), Clock::now()});
}

bool SharedMemoryPool::off() const {
  std::lock_guard<std::mutex> lock(mu_);
  return off_;
}

int64_t SharedMemoryPool::regions_made() const {
  std::lock_guard<std::mutex> lock(mu_);
  return made_;
}

SharedMemoryPool::Lease SharedMemoryPool::Acquire(uint64_t bytes) {
  std::vector<std::unique_ptr<SharedRegion>> discard;  // unregistered after the lock is released
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (off_ || Clock::now() < retry_after_) return {};
    const auto now = Clock::now();
    // A region unused for most of the server's idle timeout may be closed there already.
    for (auto it = idle_.begin(); it != idle_.end();) {
      const double timeout = it->region->idle_timeout_s();
      if (timeout > 0 && std::chrono::duration<double>(now - it->since).count() > 0.8 * timeout) {
        discard.push_back(std::move(it->region));
        it = idle_.erase(it);
      } else {
        ++it;
      }
    }
    // The smallest idle region that fits.
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if (it->region->size() >= bytes &&
          (best == idle_.end() || it->region->size() < best->region->size())) {
        best = it;
      }
    }
    if (best != idle_.end()) {
      std::unique_ptr<SharedRegion> r = std::move(best->region);
      idle_.erase(best);
      ++lent_;
      return Lease(this, std::move(r));
    }
    if (lent_ + idle_.size() >= kMaxRegions) {
      if (idle_.empty()) return {};  // every region is in use: this call takes the wire
      // None fits: the smallest idle one makes room for a larger one.
      auto smallest = std::min_element(
          idle_.begin(), idle_.end(),
          [](const Idle& a, const Idle& b) { return a.region->size() < b.region->size(); });
      discard.push_back(std::move(smallest->region));
      idle_.erase(smallest);
    }
    ++lent_;  // counted while it is made, so that concurrent calls respect the limit
  }
  discard.clear();
  const uint64_t size = PowerOfTwoAtLeast(std::max(bytes, kMinRegionBytes));
  auto made = SharedRegion::Create(client_, size);
  std::lock_guard<std::mutex> lock(mu_);
  if (!made.ok()) {
    --lent_;
    if (Lasting(made.status().code())) {
      if (!off_) {
        spdlog::debug("gradwire client: tensors to {} go over the wire: {}",
                      client_.options().server, std::string(made.status().message()));
      }
      off_ = true;
    } else {
      retry_after_ = Clock::now() + std::chrono::seconds(5);
      spdlog::debug("gradwire client: no shared-memory region from {} for now: {}",
                    client_.options().server, std::string(made.status().message()));
    }
    return {};
  }
  ++made_;
  return Lease(this, *std::move(made));
}

}  // namespace gradwire::client::internal
