// Shared-memory tensors from the client side, and the helpers that put an encoded tensor into a
// region and read one out. Client::Forward and Backward use a SharedRegion by themselves
// (ClientOptions::shared_memory); these are for requests built by hand (Client::ForwardRaw /
// BackwardRaw). docs/shared-memory.md walks through it.
//
// - SharedRegion: a region the server made for this client (CreateSharedMemory), mapped here.
// - SharedMemoryBuffer: an object this process makes, for a server started with
//   --allow-shared-memory (Client::RegisterSharedMemory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gradwire/client/client.h"
#include "gradwire/v1/tensor.pb.h"

namespace gradwire::client {

class SharedRegion {
 public:
  // Asks `client`'s server for a region of `bytes` bytes, opens and maps its object, and removes
  // the object's name, so that no other process can open it from then on. The server's refusal
  // is the error (FAILED_PRECONDITION: off, or this client is not on its host;
  // RESOURCE_EXHAUSTED: its limits), and so is an object this process cannot open or that is not
  // its user's (FAILED_PRECONDITION: another host behind a proxy, container, IPC namespace or
  // user; the region is unregistered again). `client` must outlive the region.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(Client& client, uint64_t bytes);
  // Unmaps it and unregisters it on the server (best effort, within the client's timeout).
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  const std::string& name() const { return name_; }
  char* data() { return data_; }
  const char* data() const { return data_; }
  size_t size() const { return size_; }
  // The server closes the region after this long unused (0: never).
  double idle_timeout_s() const { return idle_timeout_s_; }

 private:
  SharedRegion() = default;
  Client* client_ = nullptr;
  std::string name_;
  char* data_ = nullptr;
  size_t size_ = 0;
  double idle_timeout_s_ = 0;
};

class SharedMemoryBuffer {
 public:
  // Creates the object `key` (an optional '/' and [A-Za-z0-9._-]; it must not exist yet) with
  // `bytes` bytes, readable and writable by this user only, and maps it. ALREADY_EXISTS when the
  // key is taken.
  static absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> Create(const std::string& key,
                                                                    size_t bytes);
  // A key nobody else uses: `prefix`, this process id and random hex.
  static std::string UniqueKey(const std::string& prefix = "gradwire");
  // Unmaps and unlinks the object (a server that still holds it registered keeps its bytes until
  // it unregisters).
  ~SharedMemoryBuffer();
  SharedMemoryBuffer(const SharedMemoryBuffer&) = delete;
  SharedMemoryBuffer& operator=(const SharedMemoryBuffer&) = delete;

  const std::string& key() const { return key_; }
  char* data() { return data_; }
  const char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  SharedMemoryBuffer() = default;
  std::string key_;
  char* data_ = nullptr;
  size_t size_ = 0;
};

// Encodes `t` as `dtype` into `buffer` at `offset` (FP8 with a current scaling of its own, or
// block scales under `scaling`: both copies' codes in the buffer, the scales in the returned
// header) and returns the request tensor that references it in `region` (the name `buffer` was
// registered under, starting at the object's byte 0). INVALID_ARGUMENT when it does not fit.
absl::StatusOr<v1::Tensor> WriteShared(SharedMemoryBuffer& buffer, const std::string& region,
                                       uint64_t offset, const HostTensor& t, WireDType dtype,
                                       wire::Fp8Scaling scaling = {});

// A result the server wrote into `buffer` (registered from the object's byte 0): `header` is the
// response's tensor (dtype, shape, scale_inv, where); decoded to float32. INVALID_ARGUMENT when
// the header does not describe bytes inside the buffer.
absl::StatusOr<HostTensor> ReadShared(const SharedMemoryBuffer& buffer, const v1::Tensor& header);

// The same for a SharedRegion (its name is the region); ReadShared also decodes a result the
// server sent inline.
absl::StatusOr<v1::Tensor> WriteShared(SharedRegion& region, uint64_t offset, const HostTensor& t,
                                       WireDType dtype, wire::Fp8Scaling scaling = {});
absl::StatusOr<HostTensor> ReadShared(const SharedRegion& region, const v1::Tensor& header);

// Where a result should go: bytes [offset, offset + byte_size) of `region`.
v1::SharedMemoryRef SharedRef(const std::string& region, uint64_t offset, uint64_t byte_size);

}  // namespace gradwire::client
