#include "gradwire/client/client.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "call_util.h"
#include "gradwire/client/shared_memory.h"
#include "gradwire/wire/tensor.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "shared_memory_pool.h"

namespace gradwire::client {
namespace {

using internal::FromGrpc;
using internal::ReadToEnd;
using internal::WriteChunked;
using internal::ZeroCopyChunked;
using internal::ZeroCopyUnary;

uint64_t Aligned(uint64_t n) { return (n + 63) & ~uint64_t(63); }

// The server answers a request naming a region it no longer has with NOT_FOUND naming the region
// (a random 32-hex-digit name), before anything is read or run: the call can go again.
bool RegionGone(const grpc::Status& s, const std::string& region) {
  return s.error_code() == grpc::StatusCode::NOT_FOUND &&
         s.error_message().find(region) != std::string::npos;
}

// `call(ctx)`, a unary call whose tensors lie in `lease`'s region, on a context `client`
// prepared: its status, or nullopt when the server no longer has the region (then dropped: the
// call may go over the wire).
template <typename Call>
std::optional<absl::Status> CallInRegion(const Client& client,
                                         internal::SharedMemoryPool::Lease& lease,
                                         const char* method, const std::string& route, Call call) {
  grpc::ClientContext ctx;
  client.PrepareContext(&ctx, method, route);
  const grpc::Status s = call(&ctx);
  if (RegionGone(s, lease.region().name())) {
    lease.Drop();
    return std::nullopt;
  }
  return FromGrpc(method, s);
}

absl::StatusOr<NamedTensors> FromWireNamed(
    const google::protobuf::RepeatedPtrField<v1::NamedTensor>& named) {
  NamedTensors out;
  for (const v1::NamedTensor& n : named) {
    auto t = FromWire(n.tensor());
    if (!t.ok()) return t.status();
    out.tensors.emplace_back(n.name(), *std::move(t));
  }
  return out;
}

}  // namespace

std::string NewTraceparent(const std::string& trace_id) {
  thread_local std::mt19937_64 engine{std::random_device{}()};
  char buf[64];
  uint64_t span = 0;
  while (span == 0) span = engine();  // an all-zero parent id is invalid
  if (trace_id.size() == 32) {
    std::snprintf(buf, sizeof buf, "00-%s-%016llx-01", trace_id.c_str(),
                  static_cast<unsigned long long>(span));
  } else {
    uint64_t hi = 0, lo = 0;
    while (hi == 0 && lo == 0) hi = engine(), lo = engine();
    std::snprintf(buf, sizeof buf, "00-%016llx%016llx-%016llx-01",
                  static_cast<unsigned long long>(hi), static_cast<unsigned long long>(lo),
                  static_cast<unsigned long long>(span));
  }
  return buf;
}

// The modules a Client keeps alive (--module-ttl): a thread that learns the server's TTL, then
// sends KeepAlive for them every third of it. Stopping cancels a call in flight, so a Client goes
// at once even when its server stalls.
class Client::Keeper {
 public:
  explicit Keeper(Client& client) : client_(client) {}
  ~Keeper() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      if (inflight_ != nullptr) inflight_->TryCancel();
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void Add(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    ids_.insert(id);
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
  }
  void Remove(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    ids_.erase(id);
  }
  std::vector<std::string> ids() const {
    std::lock_guard<std::mutex> lock(mu_);
    return {ids_.begin(), ids_.end()};
  }
  int64_t calls() const { return calls_.load(); }

 private:
  // One call on `ctx`, cancellable by the destructor; false once stopping.
  template <typename Call>
  bool Send(grpc::ClientContext* ctx, std::chrono::duration<double> deadline, Call call,
            std::unique_lock<std::mutex>& lock, const std::string& route = {}) {
    client_.PrepareContext(ctx, "KeepAlive", route);
    ctx->set_deadline(
        std::min(ctx->deadline(),
                 std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline)));
    inflight_ = ctx;
    lock.unlock();
    call();
    lock.lock();
    inflight_ = nullptr;
    return !stop_;
  }

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    double ttl = -1;  // unknown yet
    while (!stop_) {
      if (ttl < 0) {
        grpc::ClientContext ctx;
        v1::GetServerInfoResponse info;
        grpc::Status s;
        if (!Send(
                &ctx, std::chrono::seconds(10),
                [&] { s = client_.stub().GetServerInfo(&ctx, {}, &info); }, lock)) {
          return;
        }
        if (!s.ok()) {  // asked again later
          cv_.wait_for(lock, std::chrono::seconds(10), [this] { return stop_; });
          continue;
        }
        ttl = info.module_ttl_s();
        if (!(ttl > 0)) return;  // no TTL on this server: nothing to renew
      }
      const auto period = std::chrono::duration<double>(std::max(ttl / 3, 0.05));
      if (cv_.wait_for(lock, period, [this] { return stop_; })) return;
      // One call per module, routed by its id: behind a proxy the modules may live on
      // different servers.
      const std::vector<std::string> ids(ids_.begin(), ids_.end());
      for (const std::string& id : ids) {
        v1::KeepAliveRequest req;
        req.add_module_ids(id);
        v1::KeepAliveResponse resp;
        grpc::ClientContext ctx;
        grpc::Status s;
        if (!Send(
                &ctx, period, [&] { s = client_.stub().KeepAlive(&ctx, req, &resp); }, lock, id)) {
          return;
        }
        ++calls_;
        if (!s.ok()) {
          spdlog::debug("gradwire client: KeepAlive of {} to {}: {}", id, client_.options().server,
                        s.error_message());
          continue;
        }
        for (const std::string& gone : resp.unknown()) {
          spdlog::warn("gradwire client: module {} is no longer on {}", gone,
                       client_.options().server);
          ids_.erase(gone);
        }
      }
    }
  }

  Client& client_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  grpc::ClientContext* inflight_ = nullptr;
  std::set<std::string> ids_;
  std::atomic<int64_t> calls_{0};
  std::thread thread_;
};

Client::Client(ClientOptions options) : options_(std::move(options)) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options_.max_message_mib << 20);
  args.SetMaxSendMessageSize(options_.max_message_mib << 20);
  if (!options_.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options_.tls_server_name);
  }
  channel_ = grpc::CreateCustomChannel(options_.server, ChannelCredentials(options_), args);
  stub_ = v1::Gradwire::NewStub(channel_);
  keeper_ = std::make_unique<Keeper>(*this);
  shm_ = std::make_unique<internal::SharedMemoryPool>(
      *this, options_.shared_memory == ClientOptions::SharedMemory::kAuto);
  background_ = std::make_shared<Background>();
}

Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)), channel_(std::move(channel)) {
  stub_ = v1::Gradwire::NewStub(channel_);
  keeper_ = std::make_unique<Keeper>(*this);
  shm_ = std::make_unique<internal::SharedMemoryPool>(
      *this, options_.shared_memory == ClientOptions::SharedMemory::kAuto);
  background_ = std::make_shared<Background>();
}

// Background ReleaseContext calls in flight: counted so that the client's destructor can wait
// for them (bounded by their deadline); their callbacks hold this, never the client.
struct Client::Background {
  std::mutex mu;
  std::condition_variable cv;
  int64_t pending = 0;
  std::atomic<int64_t> sent{0};
};

Client::~Client() {
  std::unique_lock<std::mutex> lock(background_->mu);
  background_->cv.wait_for(lock, std::chrono::seconds(3),
                           [this] { return background_->pending == 0; });
}

namespace {

// Whether `value` may go in a metadata header: printable ASCII. gRPC aborts the process on
// anything else, and a module id a caller passed in may be anything; such a call goes without the
// header, and the server names what is wrong with the id.
bool RoutableValue(const std::string& value) {
  if (value.empty() || value.size() > 256) return false;
  for (char c : value) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

}  // namespace

std::string NewRandomId() {
  thread_local std::mt19937_64 engine{std::random_device{}()};
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(engine()),
                static_cast<unsigned long long>(engine()));
  return buf;
}

namespace {

// Whether a forward that failed with `code` may still have run on the server: the call ended
// without its answer (cancelled, deadline, transport), or with one the server gives after its
// compute. A refusal of the request itself (invalid, unknown, refused by policy or for lack of
// room: RESOURCE_EXHAUSTED comes before the compute, or from a store that kept nothing) ran
// nothing, or made no context.
bool MayHaveRun(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kUnimplemented:
      return false;
    default:
      return true;
  }
}

}  // namespace

void Client::ReleaseInBackground(const std::string& context_id, const std::string& module_id) {
  struct Call {
    grpc::ClientContext ctx;
    v1::ReleaseContextRequest req;
    v1::ReleaseContextResponse resp;
  };
  auto call = std::make_shared<Call>();
  PrepareContext(&call->ctx, "ReleaseContext", module_id);
  call->ctx.set_deadline(
      std::min(call->ctx.deadline(), std::chrono::system_clock::now() + std::chrono::seconds(2)));
  call->req.set_context_id(context_id);
  {
    std::lock_guard<std::mutex> lock(background_->mu);
    ++background_->pending;
  }
  ++background_->sent;
  stub_->async()->ReleaseContext(
      &call->ctx, &call->req, &call->resp,
      [call, background = background_, server = options_.server](grpc::Status s) {
        // NOT_FOUND: the server saw the cancellation and released the context itself, or never
        // made it.
        if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) {
          spdlog::debug("gradwire client: releasing context {} on {} after its forward failed: {}",
                        call->req.context_id(), server, s.error_message());
        }
        std::lock_guard<std::mutex> lock(background->mu);
        --background->pending;
        background->cv.notify_all();
      });
}

int64_t Client::unanswered_releases() const { return background_->sent.load(); }

std::string Client::PrepareContext(grpc::ClientContext* ctx, const char* method,
                                   const std::string& route) const {
  ctx->set_deadline(std::chrono::system_clock::now() + options_.timeout);
  if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
  if (RoutableValue(route)) ctx->AddMetadata(kRouteHeader, route);
  std::string traceparent = NewTraceparent(options_.trace_id);
  ctx->AddMetadata("traceparent", traceparent);
  spdlog::debug("gradwire client: {} to {} traceparent={}", method, options_.server, traceparent);
  return traceparent;
}

absl::Status Client::WaitForReady(std::chrono::milliseconds timeout) {
  if (channel_->WaitForConnected(std::chrono::system_clock::now() + timeout)) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("cannot connect to gradwire-server at ",
                                             options_.server, " within ", timeout.count(), " ms"));
}

absl::StatusOr<v1::GetServerInfoResponse> Client::GetServerInfo() {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "GetServerInfo");
  v1::GetServerInfoResponse resp;
  if (auto s = FromGrpc("GetServerInfo", stub_->GetServerInfo(&ctx, {}, &resp)); !s.ok()) {
    return s;
  }
  return resp;
}

absl::StatusOr<std::string> Client::CheckHealth(const std::string& service) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "Health.Check");
  ::grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  ::grpc::health::v1::HealthCheckResponse resp;
  auto stub = ::grpc::health::v1::Health::NewStub(channel_);
  if (auto s = FromGrpc("Health.Check", stub->Check(&ctx, req, &resp)); !s.ok()) return s;
  return ::grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
}

std::string Client::ModuleOfContext(const std::string& context_id) const {
  return shapes_->ModuleOfContext(context_id);
}

absl::StatusOr<v1::ModuleInfo> Client::CreateModule(const v1::ModuleSpec& spec) {
  v1::CreateModuleRequest req;
  *req.mutable_spec() = spec;
  req.set_module_id(NewRandomId());
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "CreateModule", req.module_id());
  v1::CreateModuleResponse resp;
  if (auto s = FromGrpc("CreateModule", stub_->CreateModule(&ctx, req, &resp)); !s.ok()) {
    return s;
  }
  shapes_->Remember(resp.module());
  keeper_->Add(resp.module().module_id());
  return resp.module();
}

void Client::Hold(const std::string& module_id) { keeper_->Add(module_id); }

void Client::Release(const std::string& module_id) { keeper_->Remove(module_id); }

std::vector<std::string> Client::held() const { return keeper_->ids(); }

int64_t Client::keep_alive_calls() const { return keeper_->calls(); }

absl::StatusOr<std::vector<v1::ModuleInfo>> Client::ListModules(const std::string& route) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "ListModules", route);
  v1::ListModulesResponse resp;
  if (auto s = FromGrpc("ListModules", stub_->ListModules(&ctx, {}, &resp)); !s.ok()) return s;
  for (const v1::ModuleInfo& info : resp.modules()) shapes_->Remember(info);
  return std::vector<v1::ModuleInfo>(resp.modules().begin(), resp.modules().end());
}

absl::Status Client::DeleteModule(const std::string& module_id) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "DeleteModule", module_id);
  v1::DeleteModuleRequest req;
  req.set_module_id(module_id);
  v1::DeleteModuleResponse resp;
  absl::Status s = FromGrpc("DeleteModule", stub_->DeleteModule(&ctx, req, &resp));
  if (s.ok() || s.code() == absl::StatusCode::kNotFound) keeper_->Remove(module_id);
  return s;
}

absl::StatusOr<ForwardResult> Client::Forward(const std::string& module_id, const HostTensor& input,
                                              bool training) {
  bool answered = false;
  if (!training) return ForwardNamed(module_id, input, false, {}, &answered);
  const std::string context_id = NewContextId();
  absl::StatusOr<ForwardResult> result =
      ForwardNamed(module_id, input, true, context_id, &answered);
  if (!result.ok() && (answered || MayHaveRun(result.status().code()))) {
    ReleaseInBackground(context_id, module_id);
  }
  return result;
}

absl::StatusOr<ForwardResult> Client::ForwardNamed(const std::string& module_id,
                                                   const HostTensor& input, bool training,
                                                   const std::string& context_id, bool* answered) {
  // The input's and the outputs' dtypes: one for all, or the exact wire's (host_tensor.h), which
  // needs the module's spec (known from CreateModule or ListModules, else asked for once).
  // An FP8 form scales as the module's recipe does (row blocks under BLOCK and MXFP8).
  const WireForm& form = options_.wire_dtype;
  TensorForm in_form{form.dtype, {}};
  const WireDType out_dtype = form.dtype;
  if (form.exact || wire::IsFp8(form.dtype)) {
    const std::optional<ModuleShape> known = Shape(module_id);
    in_form = InputForm(form, input, known.has_value(), known && known->fp8_input,
                        known ? known->fp8_block : 0, training);
    if (form.exact && wire::IsFp8(in_form.dtype)) ++exact_fp8_inputs_;
  }
  if (options_.shared_memory == ClientOptions::SharedMemory::kAuto && !shm_->off() &&
      !input.shape.empty() && input.shape.back() > 0) {
    // The module's shape from the cache; asked of the server (ListModules) only when the input
    // alone is large enough, so that small calls never wait on a lookup.
    const int64_t min_bytes = int64_t(options_.shared_memory_min_kib) << 10;
    std::optional<ModuleShape> shape = shapes_->Find(module_id);
    if (!shape && in_form.Bytes(input.numel()) >= min_bytes) {
      shape = Shape(module_id);
    }
    if (shape) {
      const int64_t rows = input.numel() / input.shape.back();
      const int64_t output = rows * shape->out, ln = shape->layernorm_output ? rows * shape->in : 0;
      const int64_t bytes =
          in_form.Bytes(input.numel()) + (output + ln) * wire::ElementSize(out_dtype);
      if (bytes >= min_bytes) {
        if (auto shared = ForwardShared(module_id, input, in_form, out_dtype, training, context_id,
                                        output, ln, answered)) {
          return *std::move(shared);
        }
      }
    }
  }
  v1::ForwardRequest req;
  req.set_module_id(module_id);
  *req.mutable_input() = ToWire(input, in_form);
  req.set_training(training);
  req.set_context_id(context_id);
  req.set_output_dtype(ToProto(out_dtype));
  const int64_t request_bytes = int64_t(req.input().data().size());
  int64_t response_bytes = -1;
  if (options_.chunking == ClientOptions::Chunking::kAuto && !UseChunked(request_bytes, -1) &&
      !input.shape.empty() && input.shape.back() > 0) {
    if (std::optional<ModuleShape> shape = Shape(module_id)) {
      const int64_t rows = input.numel() / input.shape.back();
      response_bytes = rows * (shape->out + (shape->layernorm_output ? shape->in : 0)) *
                       wire::ElementSize(out_dtype);
    }
  }
  v1::ForwardResponse resp;
  wire::ReceivedMessage received;  // holds the unary response's tensor bytes
  absl::string_view output_bytes, ln_bytes;
  if (UseChunked(request_bytes, response_bytes)) {
    auto chunked = ForwardChunked(req);
    if (!chunked.ok()) return chunked.status();
    resp = *std::move(chunked);
    output_bytes = resp.output().data();
    ln_bytes = resp.layernorm_output().data();
  } else {
    grpc::ClientContext ctx;
    PrepareContext(&ctx, "Forward", module_id);
    if (auto s = ZeroCopyUnary(channel_.get(), "Forward", &ctx, &req, wire::kForwardRequestTensors,
                               &received, &resp, wire::kForwardResponseTensors);
        !s.ok()) {
      return s;
    }
    output_bytes = received.data(1);
    ln_bytes = received.data(4);
  }
  *answered = true;
  if (training && !resp.context_id().empty()) {
    shapes_->NoteContext(resp.context_id(), module_id, input.numel());
  }
  auto output = FromWire(resp.output(), output_bytes);
  if (!output.ok()) return output.status();
  ForwardResult result{
      *std::move(output), resp.context_id(), resp.weight_version(), {}, resp.batch_requests()};
  if (resp.has_layernorm_output()) {
    auto ln = FromWire(resp.layernorm_output(), ln_bytes);
    if (!ln.ok()) return ln.status();
    result.layernorm_output = *std::move(ln);
  }
  return result;
}

absl::StatusOr<HostTensor> Client::Backward(const std::string& context_id,
                                            const HostTensor& grad_output,
                                            BackwardOptions options) {
  // Gradients keep one dtype both ways; under the exact wire F32 (grad_layernorm_output and
  // grad_input), and grad_output as the module's own cast of it with its column sums where the
  // client can make them (GradOutputForm).
  const WireForm& form = options_.wire_dtype;
  const WireDType dtype = form.dtype;
  v1::BackwardRequest req;
  req.set_context_id(context_id);
  const std::string module_id = ModuleOfContext(context_id);  // its route
  // FP8 gradients scale as the module's recipe does (row blocks under BLOCK and MXFP8).
  const std::optional<ModuleShape> known =
      wire::IsFp8(dtype) || form.exact ? shapes_->Find(module_id) : std::nullopt;
  const int64_t block = known ? known->fp8_block : 0;
  const TensorForm grad_form = GradientForm(form, block);
  const TensorForm out_form =
      GradOutputForm(form, grad_output, known ? known->fp8_grad : ExactGradForm::kNone,
                     known && known->bias, block);
  if (form.exact && wire::IsFp8(out_form.dtype)) ++exact_fp8_gradients_;
  SetColumnSums(out_form, &req);
  req.set_retain(options.retain);
  req.set_skip_grad_input(options.skip_grad_input);
  req.set_grad_input_dtype(ToProto(dtype));
  const int64_t grad_input_elements = shapes_->TakeContext(context_id, options.retain);
  if (options_.shared_memory == ClientOptions::SharedMemory::kAuto && !shm_->off() &&
      (grad_input_elements >= 0 || options.skip_grad_input)) {
    const int64_t grad_input = options.skip_grad_input ? 0 : grad_input_elements;
    const int64_t bytes =
        out_form.Bytes(grad_output.numel()) + grad_input * wire::ElementSize(dtype) +
        (options.grad_layernorm_output ? grad_form.Bytes(options.grad_layernorm_output->numel())
                                       : 0);
    if (bytes >= int64_t(options_.shared_memory_min_kib) << 10) {
      const HostTensor* gln =
          options.grad_layernorm_output ? &*options.grad_layernorm_output : nullptr;
      if (auto shared =
              BackwardShared(module_id, req, grad_output, gln, grad_input, out_form, grad_form)) {
        return *std::move(shared);
      }
    }
  }
  *req.mutable_grad_output() = ToWire(grad_output, out_form);
  if (options.grad_layernorm_output) {
    *req.mutable_grad_layernorm_output() = ToWire(*options.grad_layernorm_output, grad_form);
  }
  const int64_t request_bytes =
      int64_t(req.grad_output().data().size() + req.grad_layernorm_output().data().size());
  const int64_t response_bytes = options.skip_grad_input ? 0
                                 : grad_input_elements < 0
                                     ? -1
                                     : grad_input_elements * wire::ElementSize(dtype);
  v1::BackwardResponse resp;
  wire::ReceivedMessage received;
  if (UseChunked(request_bytes, response_bytes)) {
    auto chunked = BackwardChunked(req, module_id);
    if (!chunked.ok()) return chunked.status();
    resp = *std::move(chunked);
    if (!resp.has_grad_input()) return HostTensor{};
    return FromWire(resp.grad_input());
  }
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "Backward", module_id);
  if (auto s = ZeroCopyUnary(channel_.get(), "Backward", &ctx, &req, wire::kBackwardRequestTensors,
                             &received, &resp, wire::kBackwardResponseTensors);
      !s.ok()) {
    return s;
  }
  if (!resp.has_grad_input()) return HostTensor{};
  return FromWire(resp.grad_input(), received.data(1));
}

std::unique_ptr<TrainStream> Client::OpenTrainStream(const std::string& route) {
  std::unique_ptr<TrainStream> t(new TrainStream());
  t->wire_dtype_ = options_.wire_dtype;
  t->shapes_ = shapes_;
  if (!options_.token.empty()) t->ctx_.AddMetadata("authorization", "Bearer " + options_.token);
  if (RoutableValue(route)) t->ctx_.AddMetadata(kRouteHeader, route);
  // One request id for the stream: the server logs each of its messages under it.
  const std::string traceparent = NewTraceparent(options_.trace_id);
  t->ctx_.AddMetadata("traceparent", traceparent);
  spdlog::debug("gradwire client: Train to {} traceparent={}", options_.server, traceparent);
  t->stream_ = stub_->Train(&t->ctx_);
  return t;
}

absl::Status Client::ReleaseContext(const std::string& context_id) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "ReleaseContext", ModuleOfContext(context_id));
  v1::ReleaseContextRequest req;
  req.set_context_id(context_id);
  (void)shapes_->TakeContext(context_id, /*keep=*/false);
  v1::ReleaseContextResponse resp;
  return FromGrpc("ReleaseContext", stub_->ReleaseContext(&ctx, req, &resp));
}

absl::Status Client::RegisterSharedMemory(const std::string& name, const std::string& key,
                                          uint64_t offset, uint64_t byte_size) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "RegisterSharedMemory");
  v1::RegisterSharedMemoryRequest req;
  req.set_name(name);
  req.set_key(key);
  req.set_offset(offset);
  req.set_byte_size(byte_size);
  v1::RegisterSharedMemoryResponse resp;
  return FromGrpc("RegisterSharedMemory", stub_->RegisterSharedMemory(&ctx, req, &resp));
}

absl::StatusOr<int> Client::UnregisterSharedMemory(const std::string& name) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "UnregisterSharedMemory");
  v1::UnregisterSharedMemoryRequest req;
  req.set_name(name);
  v1::UnregisterSharedMemoryResponse resp;
  if (auto s = FromGrpc("UnregisterSharedMemory", stub_->UnregisterSharedMemory(&ctx, req, &resp));
      !s.ok()) {
    return s;
  }
  return resp.unregistered();
}

absl::StatusOr<std::vector<v1::ListSharedMemoryResponse::Region>> Client::ListSharedMemory(
    const std::string& name) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "ListSharedMemory");
  v1::ListSharedMemoryRequest req;
  req.set_name(name);
  v1::ListSharedMemoryResponse resp;
  if (auto s = FromGrpc("ListSharedMemory", stub_->ListSharedMemory(&ctx, req, &resp)); !s.ok()) {
    return s;
  }
  return std::vector<v1::ListSharedMemoryResponse::Region>(resp.regions().begin(),
                                                           resp.regions().end());
}

absl::StatusOr<v1::ForwardResponse> Client::ForwardRaw(const v1::ForwardRequest& req) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "Forward", req.module_id());
  v1::ForwardResponse resp;
  if (auto s = FromGrpc("Forward", stub_->Forward(&ctx, req, &resp)); !s.ok()) return s;
  if (!resp.context_id().empty()) {
    int64_t elements = 1;
    for (int64_t d : req.input().shape()) elements *= d;
    shapes_->NoteContext(resp.context_id(), req.module_id(), elements);
  }
  return resp;
}

absl::StatusOr<v1::BackwardResponse> Client::BackwardRaw(const v1::BackwardRequest& req) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "Backward", ModuleOfContext(req.context_id()));
  v1::BackwardResponse resp;
  if (auto s = FromGrpc("Backward", stub_->Backward(&ctx, req, &resp)); !s.ok()) return s;
  (void)shapes_->TakeContext(req.context_id(), /*keep=*/req.retain());
  return resp;
}

absl::StatusOr<uint64_t> Client::ApplyGradients(const std::string& module_id, float learning_rate) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "ApplyGradients", module_id);
  v1::ApplyGradientsRequest req;
  req.set_module_id(module_id);
  req.set_learning_rate(learning_rate);
  v1::ApplyGradientsResponse resp;
  if (auto s = FromGrpc("ApplyGradients", stub_->ApplyGradients(&ctx, req, &resp)); !s.ok()) {
    return s;
  }
  return resp.weight_version();
}

absl::StatusOr<NamedTensors> Client::GetGradients(const std::string& module_id, bool zero) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, "GetGradients", module_id);
  v1::GetGradientsRequest req;
  req.set_module_id(module_id);
  req.set_zero(zero);
  req.set_dtype(v1::F32);
  v1::GetGradientsResponse resp;
  if (auto s = FromGrpc("GetGradients", stub_->GetGradients(&ctx, req, &resp)); !s.ok()) {
    return s;
  }
  auto out = FromWireNamed(resp.gradients());
  if (!out.ok()) return out.status();
  out->weight_version = resp.weight_version();
  out->accumulated_backwards = resp.accumulated_backwards();
  return out;
}

absl::StatusOr<NamedTensors> Client::GetWeights(const std::string& module_id) {
  v1::GetWeightsRequest req;
  req.set_module_id(module_id);
  req.set_dtype(v1::F32);
  int64_t response_bytes = -1;  // an upper bound of the parameters' bytes
  if (options_.chunking == ClientOptions::Chunking::kAuto) {
    if (std::optional<ModuleShape> m = Shape(module_id)) {
      const int64_t fc1 = (m->gated ? 2 : 1) * m->ffn;
      response_bytes =
          4 * (m->in * m->out + m->out + 2 * m->in + fc1 * m->in + fc1 + m->out * m->ffn);
    }
  }
  v1::GetWeightsResponse resp;
  if (UseChunked(0, response_bytes)) {
    auto chunked = GetWeightsChunked(req);
    if (!chunked.ok()) return chunked.status();
    resp = *std::move(chunked);
  } else {
    grpc::ClientContext ctx;
    PrepareContext(&ctx, "GetWeights", module_id);
    if (auto s = FromGrpc("GetWeights", stub_->GetWeights(&ctx, req, &resp)); !s.ok()) return s;
  }
  auto out = FromWireNamed(resp.parameters());
  if (!out.ok()) return out.status();
  out->weight_version = resp.weight_version();
  return out;
}

absl::StatusOr<uint64_t> Client::SetWeights(
    const std::string& module_id,
    const std::vector<std::pair<std::string, HostTensor>>& parameters) {
  v1::SetWeightsRequest req;
  req.set_module_id(module_id);
  for (const auto& [name, tensor] : parameters) {
    v1::NamedTensor* named = req.add_parameters();
    named->set_name(name);
    *named->mutable_tensor() = ToWire(tensor, WireDType::kF32);
  }
  int64_t request_bytes = 0;
  for (const v1::NamedTensor& named : req.parameters()) {
    request_bytes += int64_t(named.tensor().data().size());
  }
  v1::SetWeightsResponse resp;
  if (UseChunked(request_bytes, 0)) {
    auto chunked = SetWeightsChunked(req);
    if (!chunked.ok()) return chunked.status();
    resp = *std::move(chunked);
  } else {
    grpc::ClientContext ctx;
    PrepareContext(&ctx, "SetWeights", module_id);
    if (auto s = FromGrpc("SetWeights", stub_->SetWeights(&ctx, req, &resp)); !s.ok()) return s;
  }
  return resp.weight_version();
}

int64_t Client::chunked_calls() const { return chunked_calls_.load(); }

int64_t Client::shared_memory_calls() const { return shared_memory_calls_.load(); }

bool Client::shared_memory_off() const { return shm_->off(); }

std::optional<absl::StatusOr<ForwardResult>> Client::ForwardShared(
    const std::string& module_id, const HostTensor& input, const TensorForm& in_form,
    WireDType out_dtype, bool training, const std::string& context_id, int64_t output_elements,
    int64_t layernorm_elements, bool* answered) {
  const uint64_t element = uint64_t(wire::ElementSize(out_dtype));
  const uint64_t in = uint64_t(in_form.Bytes(input.numel())),
                 out = uint64_t(output_elements) * element,
                 ln = uint64_t(layernorm_elements) * element;
  internal::SharedMemoryPool::Lease lease = shm_->Acquire(Aligned(in) + Aligned(out) + ln);
  if (!lease) return std::nullopt;
  SharedRegion& region = lease.region();
  v1::ForwardRequest req;
  req.set_module_id(module_id);
  req.set_training(training);
  req.set_context_id(context_id);
  req.set_output_dtype(ToProto(out_dtype));
  auto written = WriteShared(region, 0, input, in_form.dtype, in_form.scaling);
  if (!written.ok()) return absl::StatusOr<ForwardResult>(written.status());
  *req.mutable_input() = *std::move(written);
  *req.mutable_output_shared_memory() = SharedRef(region.name(), Aligned(in), out);
  if (layernorm_elements > 0) {
    *req.mutable_layernorm_output_shared_memory() =
        SharedRef(region.name(), Aligned(in) + Aligned(out), ln);
  }
  v1::ForwardResponse resp;
  const std::optional<absl::Status> s =
      CallInRegion(*this, lease, "Forward", module_id,
                   [&](grpc::ClientContext* ctx) { return stub_->Forward(ctx, req, &resp); });
  if (!s) return std::nullopt;
  if (!s->ok()) return absl::StatusOr<ForwardResult>(*s);
  *answered = true;
  ++shared_memory_calls_;
  if (training && !resp.context_id().empty()) {
    shapes_->NoteContext(resp.context_id(), module_id, input.numel());
  }
  auto output = ReadShared(region, resp.output());
  if (!output.ok()) return absl::StatusOr<ForwardResult>(output.status());
  ForwardResult result{
      *std::move(output), resp.context_id(), resp.weight_version(), {}, resp.batch_requests()};
  if (resp.has_layernorm_output()) {
    auto ln_out = ReadShared(region, resp.layernorm_output());
    if (!ln_out.ok()) return absl::StatusOr<ForwardResult>(ln_out.status());
    result.layernorm_output = *std::move(ln_out);
  }
  return absl::StatusOr<ForwardResult>(std::move(result));
}

std::optional<absl::StatusOr<HostTensor>> Client::BackwardShared(
    const std::string& route, const v1::BackwardRequest& header, const HostTensor& grad_output,
    const HostTensor* grad_layernorm_output, int64_t grad_input_elements,
    const TensorForm& out_form, const TensorForm& ln_form) {
  const WireDType dtype = ln_form.dtype;  // grad_input's too
  const uint64_t go = uint64_t(out_form.Bytes(grad_output.numel())),
                 gln = grad_layernorm_output
                           ? uint64_t(ln_form.Bytes(grad_layernorm_output->numel()))
                           : 0,
                 gi = uint64_t(grad_input_elements) * uint64_t(wire::ElementSize(dtype));
  internal::SharedMemoryPool::Lease lease =
      shm_->Acquire(Aligned(go) + Aligned(gln) + std::max<uint64_t>(gi, 1));
  if (!lease) return std::nullopt;
  SharedRegion& region = lease.region();
  v1::BackwardRequest req = header;
  auto written = WriteShared(region, 0, grad_output, out_form.dtype, out_form.scaling);
  if (!written.ok()) return absl::StatusOr<HostTensor>(written.status());
  *req.mutable_grad_output() = *std::move(written);
  if (grad_layernorm_output != nullptr) {
    auto ln = WriteShared(region, Aligned(go), *grad_layernorm_output, dtype, ln_form.scaling);
    if (!ln.ok()) return absl::StatusOr<HostTensor>(ln.status());
    *req.mutable_grad_layernorm_output() = *std::move(ln);
  }
  if (gi > 0) {
    *req.mutable_grad_input_shared_memory() =
        SharedRef(region.name(), Aligned(go) + Aligned(gln), gi);
  }
  v1::BackwardResponse resp;
  const std::optional<absl::Status> s =
      CallInRegion(*this, lease, "Backward", route,
                   [&](grpc::ClientContext* ctx) { return stub_->Backward(ctx, req, &resp); });
  if (!s) return std::nullopt;
  if (!s->ok()) return absl::StatusOr<HostTensor>(*s);
  ++shared_memory_calls_;
  if (!resp.has_grad_input()) return absl::StatusOr<HostTensor>(HostTensor{});
  return ReadShared(region, resp.grad_input());
}

bool Client::UseChunked(int64_t request_bytes, int64_t response_bytes) const {
  switch (options_.chunking) {
    case ClientOptions::Chunking::kAlways:
      return true;
    case ClientOptions::Chunking::kNever:
      return false;
    case ClientOptions::Chunking::kAuto:
      break;
  }
  const int64_t chunk = int64_t(options_.chunk_kib) << 10;
  return request_bytes > chunk || response_bytes > chunk;
}

std::optional<ModuleShape> Client::Shape(const std::string& module_id) {
  if (std::optional<ModuleShape> known = shapes_->Find(module_id)) return known;
  // Fills the cache, asking the module's server; a failure only means the size stays unknown.
  (void)ListModules(module_id);
  return shapes_->Find(module_id);
}

void Client::StartChunked(grpc::ClientContext* ctx, const char* method, const std::string& route) {
  PrepareContext(ctx, method, route);
  ++chunked_calls_;
}

absl::StatusOr<v1::ForwardResponse> Client::ForwardChunked(v1::ForwardRequest& req) {
  grpc::ClientContext ctx;
  StartChunked(&ctx, "ForwardChunked", req.module_id());
  return ZeroCopyChunked<v1::ForwardRequestPart, v1::ForwardResponsePart, v1::ForwardResponse>(
      channel_.get(), "ForwardChunked", ctx, req, int64_t(options_.chunk_kib) << 10);
}

absl::StatusOr<v1::BackwardResponse> Client::BackwardChunked(v1::BackwardRequest& req,
                                                             const std::string& route) {
  grpc::ClientContext ctx;
  StartChunked(&ctx, "BackwardChunked", route);
  return ZeroCopyChunked<v1::BackwardRequestPart, v1::BackwardResponsePart, v1::BackwardResponse>(
      channel_.get(), "BackwardChunked", ctx, req, int64_t(options_.chunk_kib) << 10);
}

absl::StatusOr<v1::GetWeightsResponse> Client::GetWeightsChunked(const v1::GetWeightsRequest& req) {
  grpc::ClientContext ctx;
  StartChunked(&ctx, "GetWeightsChunked", req.module_id());
  auto stream = stub_->GetWeightsChunked(&ctx, req);
  return ReadToEnd<v1::GetWeightsResponsePart, v1::GetWeightsResponse>("GetWeightsChunked", ctx,
                                                                       stream.get());
}

absl::StatusOr<v1::SetWeightsResponse> Client::SetWeightsChunked(v1::SetWeightsRequest& req) {
  grpc::ClientContext ctx;
  StartChunked(&ctx, "SetWeightsChunked", req.module_id());
  v1::SetWeightsResponse resp;
  auto stream = stub_->SetWeightsChunked(&ctx, &resp);
  if (WriteChunked<v1::SetWeightsRequestPart>(stream.get(), req,
                                              int64_t(options_.chunk_kib) << 10)) {
    stream->WritesDone();
  }
  if (auto s = FromGrpc("SetWeightsChunked", stream->Finish()); !s.ok()) return s;
  return resp;
}

}  // namespace gradwire::client
