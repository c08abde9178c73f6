#include "gradwire/client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "gradwire/wire/chunking.h"
#include "gradwire/wire/codec.h"
#include "gradwire/wire/tensor.h"

namespace gradwire::client {

absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> SharedMemoryBuffer::Create(
    const std::string& key, size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a shared-memory buffer needs > 0 bytes");
  const std::string full = key.empty() || key[0] != '/' ? "/" + key : key;
  const int fd = shm_open(full.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    const std::string what =
        absl::StrCat("cannot create shared-memory object ", full, ": ", std::strerror(err));
    return err == EEXIST ? absl::AlreadyExistsError(what) : absl::InvalidArgumentError(what);
  }
  auto fail = [&](const char* step) {
    const int err = errno;
    close(fd);
    shm_unlink(full.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat(step, " of shared-memory object ", full, " failed: ", std::strerror(err)));
  };
  if (ftruncate(fd, off_t(bytes)) != 0) return fail("sizing");
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail("mapping");
  close(fd);  // the mapping keeps the object open
  std::unique_ptr<SharedMemoryBuffer> b(new SharedMemoryBuffer());
  b->key_ = full;
  b->data_ = static_cast<char*>(p);
  b->size_ = bytes;
  return b;
}

std::string SharedMemoryBuffer::UniqueKey(const std::string& prefix) {
  std::random_device rd;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%08x%08x", rd(), rd());
  return absl::StrCat("/", prefix, "-", getpid(), "-", hex);
}

SharedMemoryBuffer::~SharedMemoryBuffer() {
  if (data_ != nullptr) munmap(data_, size_);
  shm_unlink(key_.c_str());
}

v1::SharedMemoryRef SharedRef(const std::string& region, uint64_t offset, uint64_t byte_size) {
  v1::SharedMemoryRef ref;
  ref.set_region(region);
  ref.set_offset(offset);
  ref.set_byte_size(byte_size);
  return ref;
}

absl::StatusOr<v1::Tensor> WriteShared(SharedMemoryBuffer& buffer, const std::string& region,
                                       uint64_t offset, const HostTensor& t, WireDType dtype) {
  const uint64_t bytes = uint64_t(t.numel()) * uint64_t(wire::ElementSize(dtype));
  if (offset > buffer.size() || bytes > buffer.size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat("a tensor of ", bytes, " bytes at offset ",
                                                   offset, " does not fit the ", buffer.size(),
                                                   "-byte buffer ", buffer.key()));
  }
  v1::Tensor out;
  out.set_dtype(wire::ToProto(dtype));
  out.mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  const float scale_inv =
      wire::EncodeTensor(t.data.data(), t.numel(), dtype, buffer.data() + offset);
  if (wire::IsFp8(dtype)) out.set_scale_inv(scale_inv);
  *out.mutable_shared_memory() = SharedRef(region, offset, bytes);
  return out;
}

absl::StatusOr<HostTensor> ReadShared(const SharedMemoryBuffer& buffer, const v1::Tensor& header) {
  if (!header.has_shared_memory()) {
    return absl::InvalidArgumentError("the tensor does not reference shared memory");
  }
  absl::StatusOr<int64_t> bytes = wire::DataBytes(header, "tensor");
  if (!bytes.ok()) return bytes.status();
  const v1::SharedMemoryRef& ref = header.shared_memory();
  if (ref.byte_size() != uint64_t(*bytes) || ref.offset() > buffer.size() ||
      ref.byte_size() > buffer.size() - ref.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the tensor's ", ref.byte_size(), " bytes at offset ", ref.offset(), " are not the ",
        *bytes, " its shape needs inside the ", buffer.size(), "-byte buffer ", buffer.key()));
  }
  absl::StatusOr<wire::DType> dtype = wire::FromProto(header.dtype(), "tensor.dtype");
  if (!dtype.ok()) return dtype.status();
  HostTensor out;
  out.shape.assign(header.shape().begin(), header.shape().end());
  out.data.resize(size_t(out.numel()));
  wire::DecodeElements(*dtype, buffer.data() + ref.offset(), out.numel(),
                       wire::IsFp8(*dtype) ? header.scale_inv() : 1.0f, out.data.data());
  return out;
}

}  // namespace gradwire::client
