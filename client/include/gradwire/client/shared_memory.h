// Shared-memory tensors from the client side: a POSIX shared-memory object this process creates
// and maps, and the helpers that put an encoded tensor into it and read one out. The server must
// run on the same host with --allow-shared-memory; register the object with
// Client::RegisterSharedMemory, then send requests whose tensors reference it
// (Client::ForwardRaw / BackwardRaw). docs/shared-memory.md walks through it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gradwire/client/client.h"
#include "gradwire/v1/tensor.pb.h"

namespace gradwire::client {

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

// Encodes `t` as `dtype` into `buffer` at `offset` (FP8 with a current scaling of its own) and
// returns the request tensor that references it in `region` (the name `buffer` was registered
// under, starting at the object's byte 0). INVALID_ARGUMENT when it does not fit.
absl::StatusOr<v1::Tensor> WriteShared(SharedMemoryBuffer& buffer, const std::string& region,
                                       uint64_t offset, const HostTensor& t, WireDType dtype);

// A result the server wrote into `buffer` (registered from the object's byte 0): `header` is the
// response's tensor (dtype, shape, scale_inv, where); decoded to float32. INVALID_ARGUMENT when
// the header does not describe bytes inside the buffer.
absl::StatusOr<HostTensor> ReadShared(const SharedMemoryBuffer& buffer, const v1::Tensor& header);

// Where a result should go: bytes [offset, offset + byte_size) of `region`.
v1::SharedMemoryRef SharedRef(const std::string& region, uint64_t offset, uint64_t byte_size);

}  // namespace gradwire::client
