// Shared-memory tensors. A client on the same host gets a region: one the server makes for it
// (CreateSharedMemory: a 0600 object under a random key, handed only to that caller, which opens
// it and removes its name), or one it made itself and registers (RegisterSharedMemory,
// --allow-shared-memory). A request's tensor may then reference (region, offset, byte_size)
// instead of carrying its bytes, and a response may be written into a region the client names.
//
// The server never maps a client's object. It keeps the descriptor it opened at registration and
// moves bytes with pread/pwrite, which answer a short count on an object its owner truncated, where
// a mapping would raise SIGBUS in the server. A region read is the one copy of a request's bytes
// (object -> the buffer the backend reads); a response is written with one copy (encoded output ->
// object).
//
// Regions belong to their owner (the tenant with tokens; without tokens all callers share one
// namespace, as they share modules), are counted against --max-shared-memory-regions per owner,
// and are closed on unregister and when the registry is destroyed (server shutdown). A region in
// use by a call stays open until that call is done with it.
//
// RequestTensors is what a Forward or Backward uses of it: a request's tensor gathered (read from
// its region into a reused buffer, or its bytes joined there when they arrived in several slices)
// and a result delivered (into the response, or into the region the request names).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gradwire/v1/tensor.pb.h"
#include "gradwire/wire/codec.h"
#include "gradwire/wire/zero_copy.h"

namespace gradwire::rpc {

struct SharedMemoryOptions {
  // --shared-memory auto: CreateSharedMemory for callers on this host (loopback peers, Unix
  // sockets); off: never.
  bool create = true;
  // --allow-shared-memory: RegisterSharedMemory, objects a client makes and names.
  bool enabled = false;
  // Keys must start with this (after an optional '/'), so that a client can reach only the
  // objects meant for the server, not every object the server's user can open. The objects the
  // server makes carry it too.
  std::string key_prefix = "gradwire";
  int max_regions = 64;  // per owner; 0: unlimited
  // --max-shared-memory-bytes: all regions CreateSharedMemory made, together (their pages are
  // reserved when made, so a full /dev/shm is an error then and never a fault in a client).
  uint64_t max_bytes = uint64_t(2) << 30;
  // --shared-memory-idle: a region CreateSharedMemory made that no call has used for this long
  // is closed (0: never), so that a client that went away does not hold its memory.
  double idle_timeout_s = 300;
};

// Whether a gRPC peer string ("ipv4:127.0.0.1:5123", "ipv6:[::1]:5123", "unix:...") is on this
// host as far as the address says: loopback or a Unix socket.
bool SameHostPeer(absl::string_view peer);

// What CreateSharedMemory hands to the caller.
struct CreatedRegion {
  std::string name;
  std::string key;
  uint64_t byte_size = 0;
};

// A registered region, as ListSharedMemory reports it.
struct SharedMemoryRegionInfo {
  std::string name;
  std::string key;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};

class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(SharedMemoryOptions options);
  ~SharedMemoryRegistry();
  SharedMemoryRegistry(const SharedMemoryRegistry&) = delete;
  SharedMemoryRegistry& operator=(const SharedMemoryRegistry&) = delete;

  const SharedMemoryOptions& options() const { return options_; }

  // Makes an object of `byte_size` bytes, mode 0600, under a random key, reserves its pages, and
  // registers it for `owner` under a random name. FAILED_PRECONDITION when creation is off or
  // `peer` is not on this host; INVALID_ARGUMENT for a size of 0 or over --max-shared-memory-bytes;
  // RESOURCE_EXHAUSTED over the per-owner region limit, the bytes budget, or when /dev/shm has no
  // room.
  absl::StatusOr<CreatedRegion> Create(const std::string& owner, absl::string_view peer,
                                       uint64_t byte_size);
  // Closes the regions CreateSharedMemory made that no call has used for --shared-memory-idle
  // seconds; returns how many.
  int CloseIdle();

  // Opens `key` and registers bytes [offset, offset + byte_size) of it as `name`.
  // FAILED_PRECONDITION when shared memory is off; INVALID_ARGUMENT for a bad name, key or range
  // (or an object smaller than the range); ALREADY_EXISTS for a name the owner registered;
  // NOT_FOUND / PERMISSION_DENIED when the object cannot be opened; RESOURCE_EXHAUSTED over the
  // per-owner limit.
  absl::Status Register(const std::string& owner, const std::string& name, const std::string& key,
                        uint64_t offset, uint64_t byte_size);
  // Closes the owner's region `name` (NOT_FOUND when there is none), or every region of the owner
  // when `name` is empty. Returns how many were closed.
  absl::StatusOr<int> Unregister(const std::string& owner, const std::string& name);
  // The owner's regions ("" with a specific name: that one only), ordered by name.
  absl::StatusOr<std::vector<SharedMemoryRegionInfo>> List(const std::string& owner,
                                                           const std::string& name) const;
  int64_t regions() const;
  // Bytes of the regions CreateSharedMemory made that are still registered.
  uint64_t created_bytes() const;

  // The bytes `ref` names, read into `out` (which has room for ref.byte_size bytes). `field`
  // names the tensor in errors. Bounds are checked before anything is read: INVALID_ARGUMENT for a
  // range outside the region, NOT_FOUND for a region the owner has not registered,
  // FAILED_PRECONDITION when the object no longer holds the range (its owner truncated it).
  absl::Status Read(const std::string& owner, const v1::SharedMemoryRef& ref,
                    absl::string_view field, char* out) const;
  // Checks that `bytes` fit the range `ref` names (byte_size is the room there), without writing.
  absl::Status CheckRoom(const std::string& owner, const v1::SharedMemoryRef& ref,
                         absl::string_view field, uint64_t bytes) const;
  // Writes `bytes` at the start of the range `ref` names; errors as Read and CheckRoom.
  absl::Status Write(const std::string& owner, const v1::SharedMemoryRef& ref,
                     absl::string_view field, absl::string_view bytes) const;

 private:
  struct Region;
  absl::StatusOr<std::shared_ptr<const Region>> Find(const std::string& owner,
                                                     const v1::SharedMemoryRef& ref,
                                                     absl::string_view field) const;

  const SharedMemoryOptions options_;
  mutable std::mutex mu_;
  // (owner, name) -> region
  std::map<std::pair<std::string, std::string>, std::shared_ptr<const Region>> regions_;
  uint64_t created_bytes_ = 0;  // of the regions in regions_ that Create made
};

// Where shared-memory reads land, and a tensor's bytes when they arrived over several received
// slices: buffers reused by the thread that runs the calls, never zero-filled, and backed by
// transparent huge pages when large (core/heap_trim.h). In a fresh buffer a large tensor
// pays a page fault per 4 KiB page, several times the cost of the copy itself. Each thread keeps
// at most two buffers of at most kMaxRetained bytes.
class GatherBuffer {
 public:
  static constexpr size_t kMaxRetained = size_t(512) << 20;
  GatherBuffer() = default;
  ~GatherBuffer();
  GatherBuffer(const GatherBuffer&) = delete;
  GatherBuffer& operator=(const GatherBuffer&) = delete;

  // `n` bytes, valid while this lives; their contents are whatever was there.
  char* Get(size_t n);

 private:
  struct Free {
    void operator()(char* p) const;
  };
  struct Buffer {
    std::unique_ptr<char, Free> bytes;
    size_t capacity = 0;
  };
  static std::vector<Buffer>& Pool();
  Buffer buffer_;
};

// A request's tensors in and its results out, for the calls that may reference shared memory.
// `owner` is whose regions the caller sees (SharedMemoryRegistry).
class RequestTensors {
 public:
  // `registry` must outlive this; tensors read from a region are bounded by
  // `max_tensor_elements` (--max-tensor-elements; 0: unlimited) before anything is read.
  RequestTensors(const SharedMemoryRegistry& registry, int64_t max_tensor_elements)
      : registry_(registry), max_tensor_elements_(max_tensor_elements) {}

  // A checked view of tensor `t` (named `field` in errors): of its own bytes (from `raw`'s field
  // `raw_field` when the request was received raw, joined in `gathered` when they span several
  // slices), or of the bytes its shared-memory reference names, read into `gathered` after the
  // header was checked.
  absl::StatusOr<wire::TensorView> Gather(const std::string& owner, const v1::Tensor& t,
                                          absl::string_view field, GatherBuffer* gathered,
                                          const wire::ReceivedMessage* raw, int raw_field) const;
  // Moves an encoded result into `out`: into the response, or with `has_ref`, into the region
  // `ref` names, `out` then carrying the header and where the bytes went.
  absl::Status Deliver(const std::string& owner, bool has_ref, const v1::SharedMemoryRef& ref,
                       absl::string_view field, wire::EncodedTensor&& e, v1::Tensor* out) const;
  // Room for a result of `bytes` in the range `ref` names, checked before the compute.
  absl::Status CheckRoom(const std::string& owner, const v1::SharedMemoryRef& ref,
                         absl::string_view field, uint64_t bytes) const {
    return registry_.CheckRoom(owner, ref, field, bytes);
  }

 private:
  const SharedMemoryRegistry& registry_;
  const int64_t max_tensor_elements_;
};

}  // namespace gradwire::rpc
