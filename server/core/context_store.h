// Saved tensors of training forwards, kept from Forward until the matching Backward (or
// ReleaseContext) and not one moment longer.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "server/core/saved_tensors.h"

namespace gradwire::core {

class ContextStore {
 public:
  // How many consumed ids are remembered, so a second backward gets FAILED_PRECONDITION rather
  // than NOT_FOUND.
  static constexpr size_t kConsumedMemory = 1 << 16;

  // A context checked out for a backward. Keep it no longer than the backward runs.
  struct Lease {
    std::string module_id;
    uint64_t weight_version = 0;
    std::shared_ptr<SavedTensors> saved;
  };

  // Stores `saved` under a fresh random 128-bit id (32 hex digits) and returns the id.
  // `tenant` owns the context (the module's tenant); see CheckTenant.
  std::string Put(std::string module_id, uint64_t weight_version,
                  std::shared_ptr<SavedTensors> saved, std::string tenant = {});

  // NOT_FOUND, worded exactly as for an unknown id, unless `context_id` is a live or consumed
  // context of `tenant`: another tenant learns nothing about the id.
  absl::Status CheckTenant(const std::string& context_id, const std::string& tenant) const;

  // Checks a context out for a backward. NOT_FOUND for an unknown id; FAILED_PRECONDITION when it
  // was consumed already or another backward on it is running.
  absl::StatusOr<Lease> Acquire(const std::string& context_id);

  // Ends a backward started by Acquire.
  //   consumed=true:  the backward succeeded; without retain the context is erased now (drop the
  //                   lease's `saved` right after, it is then the last reference) and its id is
  //                   remembered as consumed.
  //   consumed=false: the backward failed; the context stays as it was.
  void Finish(const std::string& context_id, bool consumed, bool retain);

  // Drops a context without a backward. NOT_FOUND for an unknown id; OK for a consumed one;
  // FAILED_PRECONDITION while a backward on it runs.
  absl::Status Release(const std::string& context_id);

  // Drops every context of a module (when the module is deleted); returns how many.
  int64_t ReleaseModule(const std::string& module_id);

  int64_t live_contexts() const;
  int64_t live_bytes() const;
  int64_t live_contexts(const std::string& module_id) const;

  // For tests: a weak handle on a context's saved tensors, to prove they were freed.
  std::weak_ptr<SavedTensors> Peek(const std::string& context_id) const;

 private:
  struct Entry {
    std::string module_id;
    std::string tenant;
    uint64_t weight_version = 0;
    std::shared_ptr<SavedTensors> saved;
    int64_t bytes = 0;
    bool in_backward = false;
  };

  void EraseLocked(std::unordered_map<std::string, Entry>::iterator it, bool remember);

  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> entries_;
  std::unordered_map<std::string, std::string> consumed_;  // id -> tenant
  std::deque<std::string> consumed_order_;
  int64_t live_bytes_ = 0;
};

// A random 128-bit identifier as 32 lowercase hex digits.
std::string RandomId128();

}  // namespace gradwire::core
