#include "server/rpc/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <new>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/wire/chunking.h"
#include "gradwire/wire/tensor.h"
#include "server/common/status_macros.h"
#include "server/core/heap_trim.h"
#include "server/rpc/boundary.h"
#include "spdlog/spdlog.h"

namespace gradwire::rpc {
namespace {

constexpr size_t kMaxKeyLength = 200;  // NAME_MAX less room for the "/dev/shm/" directory
constexpr size_t kMaxRegionName = 128;

bool PlainChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

absl::Status CheckRegionName(absl::string_view field, absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  bool plain = name.size() <= kMaxRegionName;
  for (char c : name) plain = plain && PlainChar(c);
  if (!plain) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be 1 to ", kMaxRegionName,
                                                   " characters of [A-Za-z0-9._-], got \"",
                                                   Escaped(name), "\""));
  }
  return absl::OkStatus();
}

// a + b, or false when it overflows.
bool Add(uint64_t a, uint64_t b, uint64_t* sum) { return !__builtin_add_overflow(a, b, sum); }

std::string Errno(int err) { return std::strerror(err); }

absl::Status Off() {
  return absl::FailedPreconditionError(
      "shared-memory tensors are off on this server (--shared-memory off, and no "
      "--allow-shared-memory)");
}

absl::Status RegisterOff() {
  return absl::FailedPreconditionError(
      "RegisterSharedMemory is off on this server (start it with --allow-shared-memory); "
      "CreateSharedMemory makes a region for a client on this host");
}

int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// 128 random bits as 32 lowercase hex digits, from the kernel's generator.
absl::StatusOr<std::string> RandomHex() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::InternalError(absl::StrCat("getrandom failed: ", Errno(errno)));
    got += size_t(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

}  // namespace

bool SameHostPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:")) return true;
  if (absl::StartsWith(peer, "ipv4:")) return absl::StartsWith(peer, "ipv4:127.");
  if (absl::StartsWith(peer, "ipv6:")) {
    return absl::StartsWith(peer, "ipv6:[::1]") || absl::StartsWith(peer, "ipv6:%5B::1%5D") ||
           absl::StartsWith(peer, "ipv6:[::ffff:127.") ||
           absl::StartsWith(peer, "ipv6:%5B::ffff:127.");
  }
  return false;
}

struct SharedMemoryRegistry::Region {
  std::string name;
  std::string key;  // with its leading '/'
  int fd = -1;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  bool created = false;  // made by Create: its name is removed when it closes
  mutable std::atomic<int64_t> last_used_ns{SteadyNanos()};
  ~Region() {
    if (fd >= 0) close(fd);
    // The client removes the name once it has opened the object; one that never did (another
    // host behind a proxy, a client gone) leaves it to here. ENOENT is the usual answer.
    if (created) (void)shm_unlink(key.c_str());
  }
};

absl::StatusOr<CreatedRegion> SharedMemoryRegistry::Create(const std::string& owner,
                                                           absl::string_view peer,
                                                           uint64_t byte_size) {
  if (!options_.create) {
    return absl::FailedPreconditionError(
        "CreateSharedMemory is off on this server (--shared-memory off)");
  }
  if (!SameHostPeer(peer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("CreateSharedMemory is for clients on this host (loopback or a Unix socket); "
                     "this call came from ",
                     Escaped(peer)));
  }
  if (byte_size == 0 || byte_size > options_.max_bytes ||
      byte_size > uint64_t(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size must be 1 to ", options_.max_bytes,
                                                   " (--max-shared-memory-bytes); got ",
                                                   byte_size));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t mine = 0;
    for (const auto& [id, region] : regions_) mine += id.first == owner;
    if (options_.max_regions > 0 && mine >= options_.max_regions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this client has ", mine, " shared-memory regions, the limit (",
          "--max-shared-memory-regions ", options_.max_regions, "); unregister one first"));
    }
    if (created_bytes_ + byte_size > options_.max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the server's shared-memory regions hold ", created_bytes_, " bytes; ", byte_size,
          " more would pass --max-shared-memory-bytes ", options_.max_bytes));
    }
    created_bytes_ += byte_size;  // reserved now, given back below if the object cannot be made
  }
  auto region = std::make_shared<Region>();
  auto release = [&](absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    created_bytes_ -= byte_size;
    return s;
  };
  auto name = RandomHex();
  auto key = RandomHex();
  if (!name.ok()) return release(name.status());
  if (!key.ok()) return release(key.status());
  region->name = *name;
  region->key = absl::StrCat("/", options_.key_prefix, "-", *key);
  region->byte_size = byte_size;
  region->fd = shm_open(region->key.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                        S_IRUSR | S_IWUSR);
  if (region->fd < 0) {
    return release(
        absl::InternalError(absl::StrCat("cannot create a shared-memory object: ", Errno(errno))));
  }
  region->created = true;  // from here on, closing the region removes the name
  // The mode is the server's user only whatever the umask; the caller opens it as that user.
  if (fchmod(region->fd, S_IRUSR | S_IWUSR) != 0 || ftruncate(region->fd, off_t(byte_size)) != 0) {
    return release(
        absl::InternalError(absl::StrCat("cannot size a shared-memory object: ", Errno(errno))));
  }
  // Pages reserved now: a /dev/shm without room is an error here, not a SIGBUS in the client
  // when it first writes a page.
  if (const int err = posix_fallocate(region->fd, 0, off_t(byte_size)); err != 0) {
    return release(absl::ResourceExhaustedError(absl::StrCat(
        "cannot reserve ", byte_size, " bytes of shared memory (/dev/shm): ", Errno(err))));
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Checked again: other calls may have made regions meanwhile (the object was made unlocked).
  int64_t mine = 0;
  for (const auto& [id, other] : regions_) mine += id.first == owner;
  if (options_.max_regions > 0 && mine >= options_.max_regions) {
    created_bytes_ -= byte_size;
    return absl::ResourceExhaustedError(absl::StrCat(
        "this client has ", mine, " shared-memory regions, the limit (",
        "--max-shared-memory-regions ", options_.max_regions, "); unregister one first"));
  }
  regions_.emplace(std::make_pair(owner, region->name), region);
  spdlog::info("shared memory: made region {} ({} bytes) for {}{}", region->name, byte_size,
               Escaped(peer), owner.empty() ? "" : " of tenant " + owner);
  return CreatedRegion{region->name, region->key, byte_size};
}

int SharedMemoryRegistry::CloseIdle() {
  if (options_.idle_timeout_s <= 0) return 0;
  const int64_t cutoff = SteadyNanos() - int64_t(options_.idle_timeout_s * 1e9);
  std::vector<std::shared_ptr<const Region>> closing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = regions_.begin(); it != regions_.end();) {
      const Region& r = *it->second;
      if (r.created && r.last_used_ns.load(std::memory_order_relaxed) < cutoff) {
        created_bytes_ -= r.byte_size;
        closing.push_back(std::move(it->second));
        it = regions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const auto& r : closing) {
    spdlog::info(
        "shared memory: closed region {} ({} bytes), unused for {} s "
        "(--shared-memory-idle)",
        r->name, r->byte_size, options_.idle_timeout_s);
  }
  return int(closing.size());
}

uint64_t SharedMemoryRegistry::created_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return created_bytes_;
}

SharedMemoryRegistry::SharedMemoryRegistry(SharedMemoryOptions options)
    : options_(std::move(options)) {}

SharedMemoryRegistry::~SharedMemoryRegistry() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!regions_.empty()) {
    spdlog::info("shared memory: closing {} registered region(s) at shutdown", regions_.size());
  }
  regions_.clear();
}

absl::Status SharedMemoryRegistry::Register(const std::string& owner, const std::string& name,
                                            const std::string& key, uint64_t offset,
                                            uint64_t byte_size) {
  if (!options_.enabled) {
    return RegisterOff();
  }
  if (auto s = CheckRegionName("name", name); !s.ok()) return s;
  absl::string_view bare = key;
  if (!bare.empty() && bare.front() == '/') bare.remove_prefix(1);
  bool plain = !bare.empty() && bare.size() <= kMaxKeyLength && bare.front() != '.';
  for (char c : bare) plain = plain && PlainChar(c);
  if (!plain) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key must be a POSIX shared-memory name: an optional '/' then 1 to ", kMaxKeyLength,
        " characters of [A-Za-z0-9._-], not starting with '.'; got \"", Escaped(key), "\""));
  }
  if (bare.substr(0, options_.key_prefix.size()) != options_.key_prefix) {
    return absl::InvalidArgumentError(absl::StrCat("key \"", Escaped(key), "\" must start with \"",
                                                   options_.key_prefix,
                                                   "\" (the server's --shared-memory-prefix)"));
  }
  uint64_t end = 0;
  if (byte_size == 0 || !Add(offset, byte_size, &end) ||
      end > uint64_t(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "byte_size must be > 0 and offset + byte_size must fit in a file offset; got offset ",
        offset, ", byte_size ", byte_size));
  }
  const std::string full_key = absl::StrCat("/", bare);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.count({owner, name})) {
      return absl::AlreadyExistsError(absl::StrCat(
          "shared-memory region \"", name, "\" is already registered; unregister it first"));
    }
    int64_t mine = 0;
    for (const auto& [id, region] : regions_) {
      if (id.first == owner) {
        ++mine;
      } else if (region->key == full_key) {
        // One client cannot read or write what another registered under its key.
        return absl::FailedPreconditionError(
            absl::StrCat("key \"", Escaped(key), "\" is registered by another client"));
      }
    }
    if (options_.max_regions > 0 && mine >= options_.max_regions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this client has ", mine, " shared-memory regions, the limit (",
          "--max-shared-memory-regions ", options_.max_regions, "); unregister one first"));
    }
  }
  auto region = std::make_shared<Region>();
  region->name = name;
  region->key = full_key;
  region->offset = offset;
  region->byte_size = byte_size;
  region->fd = shm_open(full_key.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
  if (region->fd < 0) {
    const int err = errno;
    const std::string what =
        absl::StrCat("cannot open shared-memory object \"", Escaped(key), "\": ", Errno(err));
    if (err == ENOENT) return absl::NotFoundError(what);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(what);
    return absl::InvalidArgumentError(what);
  }
  struct stat st {};
  if (fstat(region->fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", Escaped(key), "\" is not a shared-memory object"));
  }
  if (uint64_t(st.st_size) < end) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory object \"", Escaped(key), "\" has ", st.st_size,
                     " bytes; the region needs offset + byte_size = ", end));
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Checked again: another call may have registered the name meanwhile (the open ran unlocked).
  int64_t mine = 0;
  for (const auto& [id, other] : regions_) mine += id.first == owner;
  if (regions_.count({owner, name}) || (options_.max_regions > 0 && mine >= options_.max_regions)) {
    return absl::AbortedError(
        absl::StrCat("shared-memory region \"", name, "\" was registered concurrently; retry"));
  }
  regions_.emplace(std::make_pair(owner, name), region);
  spdlog::info("shared memory: registered region \"{}\" ({}, offset {}, {} bytes){}", name,
               full_key, offset, byte_size, owner.empty() ? "" : " for tenant " + owner);
  return absl::OkStatus();
}

absl::StatusOr<int> SharedMemoryRegistry::Unregister(const std::string& owner,
                                                     const std::string& name) {
  if (!options_.enabled && !options_.create) {
    return Off();
  }
  std::vector<std::shared_ptr<const Region>> closing;  // closed after the lock is released
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!name.empty()) {
      if (auto s = CheckRegionName("name", name); !s.ok()) return s;
      auto it = regions_.find({owner, name});
      if (it == regions_.end()) {
        return absl::NotFoundError(
            absl::StrCat("shared-memory region \"", name, "\" is not registered"));
      }
      if (it->second->created) created_bytes_ -= it->second->byte_size;
      closing.push_back(std::move(it->second));
      regions_.erase(it);
    } else {
      for (auto it = regions_.begin(); it != regions_.end();) {
        if (it->first.first == owner) {
          if (it->second->created) created_bytes_ -= it->second->byte_size;
          closing.push_back(std::move(it->second));
          it = regions_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  for (const auto& r : closing) spdlog::info("shared memory: unregistered region \"{}\"", r->name);
  return int(closing.size());
}

absl::StatusOr<std::vector<SharedMemoryRegionInfo>> SharedMemoryRegistry::List(
    const std::string& owner, const std::string& name) const {
  if (!options_.enabled && !options_.create) {
    return Off();
  }
  if (!name.empty()) {
    if (auto s = CheckRegionName("name", name); !s.ok()) return s;
  }
  std::vector<SharedMemoryRegionInfo> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, r] : regions_) {
    if (id.first != owner || (!name.empty() && id.second != name)) continue;
    out.push_back({r->name, r->key, r->offset, r->byte_size});
  }
  if (!name.empty() && out.empty()) {
    return absl::NotFoundError(
        absl::StrCat("shared-memory region \"", name, "\" is not registered"));
  }
  return out;
}

int64_t SharedMemoryRegistry::regions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int64_t(regions_.size());
}

absl::StatusOr<std::shared_ptr<const SharedMemoryRegistry::Region>> SharedMemoryRegistry::Find(
    const std::string& owner, const v1::SharedMemoryRef& ref, absl::string_view field) const {
  if (!options_.enabled && !options_.create) {
    return absl::FailedPreconditionError(
        absl::StrCat(field,
                     " references shared memory, which is off on this server (--shared-memory "
                     "off, and no --allow-shared-memory)"));
  }
  if (auto s = CheckRegionName(absl::StrCat(field, ".region"), ref.region()); !s.ok()) return s;
  std::shared_ptr<const Region> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find({owner, ref.region()});
    if (it == regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat(field, ": shared-memory region \"", ref.region(), "\" is not registered"));
    }
    region = it->second;
  }
  region->last_used_ns.store(SteadyNanos(), std::memory_order_relaxed);
  uint64_t end = 0;
  if (!Add(ref.offset(), ref.byte_size(), &end) || end > region->byte_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": offset ", ref.offset(), " + byte_size ", ref.byte_size(),
                     " is outside region \"", ref.region(), "\" (", region->byte_size, " bytes)"));
  }
  return region;
}

absl::Status SharedMemoryRegistry::Read(const std::string& owner, const v1::SharedMemoryRef& ref,
                                        absl::string_view field, char* dst) const {
  auto region = Find(owner, ref, field);
  if (!region.ok()) return region.status();
  const Region& r = **region;
  uint64_t done = 0;
  const uint64_t at = r.offset + ref.offset();
  while (done < ref.byte_size()) {
    const ssize_t n = pread(r.fd, dst + done, size_t(ref.byte_size() - done), off_t(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": shared-memory region \"", ref.region(), "\" no longer holds bytes [",
          ref.offset(), ", ", ref.offset() + ref.byte_size(),
          ") (its object was truncated?); nothing was run", n < 0 ? ": " + Errno(errno) : ""));
    }
    done += uint64_t(n);
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::CheckRoom(const std::string& owner,
                                             const v1::SharedMemoryRef& ref,
                                             absl::string_view field, uint64_t bytes) const {
  auto region = Find(owner, ref, field);
  if (!region.ok()) return region.status();
  if (bytes > ref.byte_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": the result needs ", bytes, " bytes; byte_size gives room for ", ref.byte_size()));
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Write(const std::string& owner, const v1::SharedMemoryRef& ref,
                                         absl::string_view field, absl::string_view bytes) const {
  auto region = Find(owner, ref, field);
  if (!region.ok()) return region.status();
  if (bytes.size() > ref.byte_size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": the result needs ", bytes.size(),
                                                   " bytes; byte_size gives room for ",
                                                   ref.byte_size()));
  }
  const Region& r = **region;
  const uint64_t at = r.offset + ref.offset();
  // pwrite on a truncated object would grow it again: refuse instead when it has shrunk.
  struct stat st {};
  if (fstat(r.fd, &st) != 0 || uint64_t(st.st_size) < at + bytes.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": shared-memory region \"", ref.region(),
                     "\" no longer holds the range to write (its object was truncated?)"));
  }
  uint64_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n =
        pwrite(r.fd, bytes.data() + done, bytes.size() - size_t(done), off_t(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(field, ": writing shared-memory region \"",
                                                        ref.region(), "\" failed: ", Errno(errno)));
    }
    done += uint64_t(n);
  }
  return absl::OkStatus();
}

GatherBuffer::~GatherBuffer() {
  std::vector<Buffer>& pool = Pool();
  if (!buffer_.bytes || buffer_.capacity > kMaxRetained) return;  // freed by its deleter
  pool.push_back(std::move(buffer_));
  if (pool.size() > 2) {  // keep the two largest: the next large tensor finds its buffer warm
    pool.erase(std::min_element(pool.begin(), pool.end(), [](const Buffer& a, const Buffer& b) {
      return a.capacity < b.capacity;
    }));
  }
}

char* GatherBuffer::Get(size_t n) {
  if (buffer_.capacity < n) {
    std::vector<Buffer>& pool = Pool();
    auto fits =
        std::find_if(pool.begin(), pool.end(), [n](const Buffer& b) { return b.capacity >= n; });
    if (fits != pool.end()) {
      buffer_ = std::move(*fits);
      pool.erase(fits);
    } else {
      buffer_.bytes.reset(static_cast<char*>(core::AllocateHostBuffer(n)));
      if (!buffer_.bytes) throw std::bad_alloc();
      buffer_.capacity = n;
    }
  }
  return buffer_.bytes.get();
}

void GatherBuffer::Free::operator()(char* p) const { core::FreeHostBuffer(p); }

std::vector<GatherBuffer::Buffer>& GatherBuffer::Pool() {
  thread_local std::vector<Buffer> pool;
  return pool;
}

absl::StatusOr<wire::TensorView> RequestTensors::Gather(
    const std::string& owner, const v1::Tensor& t, absl::string_view field, GatherBuffer* gathered,
    const wire::ReceivedMessage* raw, int raw_field) const {
  if (!t.has_shared_memory() && raw != nullptr && raw->pieces(raw_field).size() > 1) {
    // The bytes arrived in several slices: gathered once into a reused buffer (the copy an f32
    // tensor needs anyway to be contiguous), not joined into a fresh one.
    const size_t n = raw->size(raw_field);
    char* at = gathered->Get(n);
    size_t offset = 0;
    for (absl::string_view piece : raw->pieces(raw_field)) {
      std::memcpy(at + offset, piece.data(), piece.size());
      offset += piece.size();
    }
    return wire::ViewOf(t, absl::string_view(at, n), field);
  }
  const absl::string_view received = raw != nullptr ? raw->data(raw_field) : t.data();
  if (!t.has_shared_memory()) return wire::ViewOf(t, received, field);
  if (!received.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " carries both data and shared_memory; send one of them"));
  }
  // The header first: nothing is read (or allocated) for a malformed or oversize tensor.
  GW_ASSIGN_OR_RETURN(const int64_t bytes, wire::DataBytes(t, field));
  if (uint64_t(bytes) != t.shared_memory().byte_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shared_memory.byte_size is ", t.shared_memory().byte_size(), "; shape [",
        absl::StrJoin(t.shape(), ", "), "] of ", v1::DType_Name(t.dtype()), " needs ", bytes));
  }
  GW_RETURN_IF_ERROR(CheckElements(field, ShapeElements(t), max_tensor_elements_));
  char* bytes_at = gathered->Get(size_t(bytes));
  GW_RETURN_IF_ERROR(
      registry_.Read(owner, t.shared_memory(), absl::StrCat(field, ".shared_memory"), bytes_at));
  // The view checks the header as for any tensor; the shared-memory reference is what it was.
  v1::Tensor header;
  header.set_dtype(t.dtype());
  *header.mutable_shape() = t.shape();
  header.set_scale_inv(t.scale_inv());
  if (t.has_block_scales()) *header.mutable_block_scales() = t.block_scales();
  if (t.has_columnwise_scales()) *header.mutable_columnwise_scales() = t.columnwise_scales();
  return wire::ViewOf(header, absl::string_view(bytes_at, size_t(bytes)), field);
}

absl::Status RequestTensors::Deliver(const std::string& owner, bool has_ref,
                                     const v1::SharedMemoryRef& ref, absl::string_view field,
                                     wire::EncodedTensor&& e, v1::Tensor* out) const {
  if (!has_ref) {
    wire::ToMessage(std::move(e), out);
    return absl::OkStatus();
  }
  GW_RETURN_IF_ERROR(registry_.Write(owner, ref, field, e.bytes));
  const uint64_t written = e.bytes.size();
  wire::ToMessage(std::move(e), out);
  out->clear_data();
  *out->mutable_shared_memory() = ref;
  out->mutable_shared_memory()->set_byte_size(written);
  return absl::OkStatus();
}

}  // namespace gradwire::rpc
