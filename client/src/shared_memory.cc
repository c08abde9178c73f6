#include "gradwire/client/shared_memory.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
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

namespace {

absl::StatusOr<v1::Tensor> WriteAt(char* base, size_t size, const std::string& what,
                                   const std::string& region, uint64_t offset, const HostTensor& t,
                                   WireDType dtype, wire::Fp8Scaling scaling) {
  const bool blocked = wire::IsFp8(dtype) && scaling.block > 0;
  const uint64_t bytes = blocked ? uint64_t(wire::Fp8Bytes(t.numel(), scaling))
                                 : uint64_t(t.numel()) * uint64_t(wire::ElementSize(dtype));
  if (offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("a tensor of ", bytes, " bytes at offset ",
                                                   offset, " does not fit the ", size, "-byte ",
                                                   what));
  }
  v1::Tensor out;
  out.set_dtype(wire::ToProto(dtype));
  out.mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  if (blocked) {
    const int64_t cols = t.shape.empty() ? 0 : t.shape.back();
    wire::BlockScales columnwise;
    const wire::BlockScales rowwise =
        wire::EncodeBlocks(t.data.data(), cols > 0 ? t.numel() / cols : 0, cols, dtype, scaling,
                           base + offset, &columnwise);
    wire::ToMessage(rowwise, out.mutable_block_scales());
    if (columnwise.present()) wire::ToMessage(columnwise, out.mutable_columnwise_scales());
  } else {
    const float scale_inv = wire::EncodeTensor(t.data.data(), t.numel(), dtype, base + offset);
    if (wire::IsFp8(dtype)) out.set_scale_inv(scale_inv);
  }
  *out.mutable_shared_memory() = SharedRef(region, offset, bytes);
  return out;
}

absl::StatusOr<HostTensor> ReadAt(const char* base, size_t size, const std::string& what,
                                  const v1::Tensor& header) {
  if (!header.has_shared_memory()) {
    return absl::InvalidArgumentError("the tensor does not reference shared memory");
  }
  absl::StatusOr<int64_t> bytes = wire::DataBytes(header, "tensor");
  if (!bytes.ok()) return bytes.status();
  const v1::SharedMemoryRef& ref = header.shared_memory();
  if (ref.byte_size() != uint64_t(*bytes) || ref.offset() > size ||
      ref.byte_size() > size - ref.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the tensor's ", ref.byte_size(), " bytes at offset ", ref.offset(), " are not the ",
        *bytes, " its shape needs inside the ", size, "-byte ", what));
  }
  // The header's every other check is the wire's (dtype, scales), over the bytes in the buffer.
  v1::Tensor inline_header = header;
  inline_header.clear_shared_memory();
  absl::StatusOr<wire::TensorView> view =
      wire::ViewOf(inline_header, absl::string_view(base + ref.offset(), size_t(*bytes)), "tensor");
  if (!view.ok()) return view.status();
  HostTensor out;
  out.shape = view->shape;
  out.data.resize(size_t(out.numel()));
  wire::DecodeView(*view, out.data.data());
  return out;
}

}  // namespace

absl::StatusOr<v1::Tensor> WriteShared(SharedMemoryBuffer& buffer, const std::string& region,
                                       uint64_t offset, const HostTensor& t, WireDType dtype,
                                       wire::Fp8Scaling scaling) {
  return WriteAt(buffer.data(), buffer.size(), "buffer " + buffer.key(), region, offset, t, dtype,
                 scaling);
}

absl::StatusOr<HostTensor> ReadShared(const SharedMemoryBuffer& buffer, const v1::Tensor& header) {
  return ReadAt(buffer.data(), buffer.size(), "buffer " + buffer.key(), header);
}

absl::StatusOr<v1::Tensor> WriteShared(SharedRegion& region, uint64_t offset, const HostTensor& t,
                                       WireDType dtype, wire::Fp8Scaling scaling) {
  return WriteAt(region.data(), region.size(), "region " + region.name(), region.name(), offset, t,
                 dtype, scaling);
}

absl::StatusOr<HostTensor> ReadShared(const SharedRegion& region, const v1::Tensor& header) {
  if (!header.has_shared_memory()) return FromWire(header);  // the server sent it inline
  if (header.shared_memory().region() != region.name()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the tensor lies in region ", header.shared_memory().region(), ", not ", region.name()));
  }
  return ReadAt(region.data(), region.size(), "region " + region.name(), header);
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(Client& client, uint64_t bytes) {
  v1::CreateSharedMemoryResponse made;
  {
    grpc::ClientContext ctx;
    client.PrepareContext(&ctx, "CreateSharedMemory");
    v1::CreateSharedMemoryRequest req;
    req.set_byte_size(bytes);
    const grpc::Status s = client.stub().CreateSharedMemory(&ctx, req, &made);
    if (!s.ok()) {
      return absl::Status(absl::StatusCode(int(s.error_code())),
                          absl::StrCat("CreateSharedMemory: ", s.error_message()));
    }
  }
  // From here on the region exists on the server: every failure unregisters it.
  auto refuse = [&](const std::string& why) {
    (void)client.UnregisterSharedMemory(made.region());
    return absl::FailedPreconditionError(
        absl::StrCat("shared-memory region from ", client.options().server, ": ", why));
  };
  if (made.byte_size() < bytes || made.key().empty() || made.key()[0] != '/') {
    return refuse("the server's answer does not describe the region asked for");
  }
  const int fd = shm_open(made.key().c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) {
    return refuse(absl::StrCat("cannot open ", made.key(), ": ", std::strerror(errno),
                               " (another host, container or user than the server's?)"));
  }
  // Whatever happens next, the name goes: nobody else may open the object after this process.
  shm_unlink(made.key().c_str());
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & 077) != 0 || uint64_t(st.st_size) < made.byte_size()) {
    close(fd);
    return refuse(
        absl::StrCat(made.key(), " is not a ", made.byte_size(), "-byte object of this user only"));
  }
  void* p = mmap(nullptr, size_t(made.byte_size()), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);  // the mapping keeps the object
  if (p == MAP_FAILED) return refuse(absl::StrCat("cannot map it: ", std::strerror(err)));
  std::unique_ptr<SharedRegion> r(new SharedRegion());
  r->client_ = &client;
  r->name_ = made.region();
  r->data_ = static_cast<char*>(p);
  r->size_ = size_t(made.byte_size());
  r->idle_timeout_s_ = made.idle_timeout_s();
  return r;
}

SharedRegion::~SharedRegion() {
  if (data_ != nullptr) munmap(data_, size_);
  if (client_ == nullptr) return;
  // Best effort within a second: a server that cannot answer closes the region itself once it
  // has gone unused for --shared-memory-idle.
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx, "UnregisterSharedMemory");
  ctx.set_deadline(
      std::min(ctx.deadline(), std::chrono::system_clock::now() + std::chrono::seconds(1)));
  v1::UnregisterSharedMemoryRequest req;
  req.set_name(name_);
  v1::UnregisterSharedMemoryResponse resp;
  (void)client_->stub().UnregisterSharedMemory(&ctx, req, &resp);
}

}  // namespace gradwire::client
