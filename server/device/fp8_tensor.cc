#include "server/device/fp8_tensor.h"

#include <mutex>
#include <stdexcept>
#include <utility>

namespace gradwire::device {

struct CastScalars::Pending {
  std::mutex mu;
  Reader reader;
  bool read = false;
  std::array<float, 3> v{};
};

CastScalars::CastScalars(Reader reader) : pending_(std::make_shared<Pending>()) {
  if (!reader) throw std::logic_error("CastScalars: an empty reader");
  pending_->reader = std::move(reader);
}

bool CastScalars::pending() const {
  if (!pending_) return false;
  std::lock_guard<std::mutex> lock(pending_->mu);
  return !pending_->read;
}

const std::array<float, 3>& CastScalars::Values() const {
  if (!pending_) return v_;
  std::lock_guard<std::mutex> lock(pending_->mu);
  if (!pending_->read) {
    pending_->v = pending_->reader();  // a throw leaves it pending, to be asked again
    pending_->read = true;
    pending_->reader = nullptr;  // lets go of what it held (a host buffer)
  }
  return pending_->v;  // never written again
}

}  // namespace gradwire::device
