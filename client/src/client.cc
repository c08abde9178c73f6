#include "gradwire/client/client.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/impl/codegen/rpc_method.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "gradwire/wire/chunking.h"
#include "gradwire/wire/zero_copy.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace gradwire::client {
namespace {

absl::Status FromGrpc(const char* method, const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(method, ": ", s.error_message()));
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

// Writes `msg` as a chunked message: header, then its tensors' bytes in chunks.
template <typename Part, typename Msg, typename Writer>
bool WriteChunked(Writer* writer, Msg& msg, int64_t chunk_bytes) {
  wire::ChunkSplitter splitter(wire::Slots(msg), chunk_bytes);  // takes the data out of msg
  Part part;
  *part.mutable_header() = std::move(msg);
  if (!writer->Write(part)) return false;
  part.Clear();
  while (splitter.Next(part.mutable_chunk())) {
    if (!writer->Write(part)) return false;
    part.Clear();
  }
  return true;
}

// Reads a chunked message into `out`. A malformed sequence is the server's fault: INTERNAL.
// `*open` says whether the stream is still open (the caller must cancel it before Finish); when
// it ended, Finish has the server's status (an error refused before any header comes this way).
template <typename Part, typename Msg, typename Reader>
absl::Status ReadChunked(const char* method, Reader* reader, Msg* out, bool* open) {
  *open = true;
  Part part;
  bool started = false;
  wire::ChunkAssembler assembler;
  auto malformed = [method](const absl::Status& s) {
    return absl::InternalError(
        absl::StrCat(method, ": the server sent a malformed chunked response: ", s.message()));
  };
  while (reader->Read(&part)) {
    if (part.has_header()) {
      if (started) return malformed(absl::InvalidArgumentError("the header came twice"));
      started = true;
      *out = std::move(*part.mutable_header());
      // The response's size is what the client asked for: no limit beyond the shapes' own.
      absl::Status s = assembler.Start(wire::Slots(*out), std::numeric_limits<int64_t>::max(),
                                       "the client's limit", std::numeric_limits<int64_t>::max());
      if (!s.ok()) return malformed(s);
    } else if (part.has_chunk()) {
      if (!started) return malformed(absl::InvalidArgumentError("a chunk came before the header"));
      if (absl::Status s = assembler.Add(part.chunk()); !s.ok()) return malformed(s);
    }
    part.Clear();
  }
  *open = false;
  if (!started) return malformed(absl::InvalidArgumentError("no header"));
  if (absl::Status s = assembler.Complete(); !s.ok()) return malformed(s);
  return absl::OkStatus();
}

// Reads a chunked response to its end and finishes the call. A malformed response (the read
// failed while the stream was still open) wins over the CANCELLED of the cancel that closes it;
// otherwise the server's status comes first, then the read's.
template <typename Part, typename Msg, typename Stream>
absl::StatusOr<Msg> ReadToEnd(const char* method, grpc::ClientContext& ctx, Stream* stream) {
  Msg resp;
  bool open = false;
  absl::Status read = ReadChunked<Part>(method, stream, &resp, &open);
  if (!read.ok() && open) {
    ctx.TryCancel();
    (void)stream->Finish();
    return read;
  }
  if (auto s = FromGrpc(method, stream->Finish()); !s.ok()) return s;
  if (!read.ok()) return read;
  return resp;
}

// A bidi chunked call: writes `req` in chunks, then reads the response.
template <typename ReqPart, typename RespPart, typename Resp, typename Req, typename Stream>
absl::StatusOr<Resp> CallChunked(const char* method, grpc::ClientContext& ctx, Stream* stream,
                                 Req& req, int64_t chunk_bytes) {
  if (WriteChunked<ReqPart>(stream, req, chunk_bytes)) stream->WritesDone();
  return ReadToEnd<RespPart, Resp>(method, ctx, stream);
}

}  // namespace

const HostTensor* NamedTensors::Find(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return shape.empty() ? 0 : n;
}

HostTensor HostTensor::Zeros(std::vector<int64_t> shape) {
  HostTensor t;
  t.shape = std::move(shape);
  t.data.assign(size_t(t.numel()), 0.0f);
  return t;
}

v1::Tensor ToWire(const HostTensor& t, WireDType dtype) {
  v1::Tensor out;
  wire::EncodeToMessage(t.data.data(), t.shape, dtype, &out);
  return out;
}

absl::StatusOr<HostTensor> FromWire(const v1::Tensor& t) { return FromWire(t, t.data()); }

absl::StatusOr<HostTensor> FromWire(const v1::Tensor& t, absl::string_view data) {
  absl::StatusOr<wire::TensorView> view = wire::ViewOf(t, data, "response tensor");
  if (!view.ok()) return view.status();
  HostTensor out;
  out.shape = view->shape;
  out.data.resize(size_t(view->numel()));
  wire::DecodeElements(view->dtype, view->data, view->numel(), view->scale_inv, out.data.data());
  return out;
}

namespace {

// A unary call whose tensor bytes skip protobuf's copies both ways (gradwire/wire/zero_copy.h):
// the request's tensor data is moved into slices of its own, and the response's is left in the
// received slices for `received` to hand out. The bytes on the wire are the standard encoding.
template <typename Req, typename Resp>
absl::Status ZeroCopyUnary(grpc::ChannelInterface* channel, const char* method,
                           grpc::ClientContext* ctx, Req* req,
                           std::initializer_list<int> request_tensors,
                           wire::ReceivedMessage* received, Resp* resp,
                           std::initializer_list<int> response_tensors) {
  grpc::ByteBuffer out, in;
  wire::SerializeMoving(req, request_tensors, &out);
  const std::string path = absl::StrCat("/gradwire.v1.Gradwire/", method);
  const grpc::internal::RpcMethod rpc(path.c_str(), grpc::internal::RpcMethod::NORMAL_RPC);
  const grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel, rpc, ctx, out, &in);
  if (!s.ok()) return FromGrpc(method, s);
  if (absl::Status parsed = received->Parse(in, resp, response_tensors); !parsed.ok()) {
    return absl::InternalError(absl::StrCat(method, ": malformed response: ", parsed.message()));
  }
  return absl::OkStatus();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::shared_ptr<grpc::ChannelCredentials> Credentials(const ClientOptions& o) {
  if (o.tls_ca_file.empty() && o.tls_cert_file.empty() && o.tls_key_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions tls;
  if (!o.tls_ca_file.empty()) tls.pem_root_certs = ReadFile(o.tls_ca_file);
  if (!o.tls_cert_file.empty()) tls.pem_cert_chain = ReadFile(o.tls_cert_file);
  if (!o.tls_key_file.empty()) tls.pem_private_key = ReadFile(o.tls_key_file);
  return grpc::SslCredentials(tls);
}

}  // namespace

Client::Client(ClientOptions options) : options_(std::move(options)) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options_.max_message_mib << 20);
  args.SetMaxSendMessageSize(options_.max_message_mib << 20);
  if (!options_.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options_.tls_server_name);
  }
  channel_ = grpc::CreateCustomChannel(options_.server, Credentials(options_), args);
  stub_ = v1::Gradwire::NewStub(channel_);
}

Client::~Client() = default;

void Client::PrepareContext(grpc::ClientContext* ctx) const {
  ctx->set_deadline(std::chrono::system_clock::now() + options_.timeout);
  if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
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
  PrepareContext(&ctx);
  v1::GetServerInfoResponse resp;
  if (auto s = FromGrpc("GetServerInfo", stub_->GetServerInfo(&ctx, {}, &resp)); !s.ok()) {
    return s;
  }
  return resp;
}

absl::StatusOr<std::string> Client::CheckHealth(const std::string& service) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  ::grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  ::grpc::health::v1::HealthCheckResponse resp;
  auto stub = ::grpc::health::v1::Health::NewStub(channel_);
  if (auto s = FromGrpc("Health.Check", stub->Check(&ctx, req, &resp)); !s.ok()) return s;
  return ::grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
}

absl::StatusOr<v1::ModuleInfo> Client::CreateModule(const v1::ModuleSpec& spec) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::CreateModuleRequest req;
  *req.mutable_spec() = spec;
  v1::CreateModuleResponse resp;
  if (auto s = FromGrpc("CreateModule", stub_->CreateModule(&ctx, req, &resp)); !s.ok()) {
    return s;
  }
  Remember(resp.module());
  return resp.module();
}

absl::StatusOr<std::vector<v1::ModuleInfo>> Client::ListModules() {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::ListModulesResponse resp;
  if (auto s = FromGrpc("ListModules", stub_->ListModules(&ctx, {}, &resp)); !s.ok()) return s;
  for (const v1::ModuleInfo& info : resp.modules()) Remember(info);
  return std::vector<v1::ModuleInfo>(resp.modules().begin(), resp.modules().end());
}

absl::Status Client::DeleteModule(const std::string& module_id) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::DeleteModuleRequest req;
  req.set_module_id(module_id);
  v1::DeleteModuleResponse resp;
  return FromGrpc("DeleteModule", stub_->DeleteModule(&ctx, req, &resp));
}

absl::StatusOr<ForwardResult> Client::Forward(const std::string& module_id, const HostTensor& input,
                                              bool training) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::ForwardRequest req;
  req.set_module_id(module_id);
  *req.mutable_input() = ToWire(input, options_.wire_dtype);
  req.set_training(training);
  req.set_output_dtype(ToProto(options_.wire_dtype));
  const int64_t request_bytes = int64_t(req.input().data().size());
  int64_t response_bytes = -1;
  if (options_.chunking == ClientOptions::Chunking::kAuto && !UseChunked(request_bytes, -1) &&
      !input.shape.empty() && input.shape.back() > 0) {
    if (std::optional<ModuleShape> shape = Shape(module_id)) {
      const int64_t rows = input.numel() / input.shape.back();
      response_bytes = rows * (shape->out + (shape->layernorm_output ? shape->in : 0)) *
                       wire::ElementSize(ToProto(options_.wire_dtype));
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
    if (auto s = ZeroCopyUnary(channel_.get(), "Forward", &ctx, &req, wire::kForwardRequestTensors,
                               &received, &resp, wire::kForwardResponseTensors);
        !s.ok()) {
      return s;
    }
    output_bytes = received.data(1);
    ln_bytes = received.data(4);
  }
  if (training && !resp.context_id().empty()) NoteContext(resp.context_id(), input.numel());
  auto output = FromWire(resp.output(), output_bytes);
  if (!output.ok()) return output.status();
  ForwardResult result{*std::move(output), resp.context_id(), resp.weight_version(), {}};
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
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::BackwardRequest req;
  req.set_context_id(context_id);
  *req.mutable_grad_output() = ToWire(grad_output, options_.wire_dtype);
  req.set_retain(options.retain);
  req.set_skip_grad_input(options.skip_grad_input);
  req.set_grad_input_dtype(ToProto(options_.wire_dtype));
  if (options.grad_layernorm_output) {
    *req.mutable_grad_layernorm_output() =
        ToWire(*options.grad_layernorm_output, options_.wire_dtype);
  }
  const int64_t request_bytes =
      int64_t(req.grad_output().data().size() + req.grad_layernorm_output().data().size());
  const int64_t grad_input_elements = TakeContext(context_id, options.retain);
  const int64_t response_bytes =
      options.skip_grad_input ? 0
      : grad_input_elements < 0
          ? -1
          : grad_input_elements * wire::ElementSize(ToProto(options_.wire_dtype));
  v1::BackwardResponse resp;
  wire::ReceivedMessage received;
  if (UseChunked(request_bytes, response_bytes)) {
    auto chunked = BackwardChunked(req);
    if (!chunked.ok()) return chunked.status();
    resp = *std::move(chunked);
    if (!resp.has_grad_input()) return HostTensor{};
    return FromWire(resp.grad_input());
  }
  if (auto s = ZeroCopyUnary(channel_.get(), "Backward", &ctx, &req, wire::kBackwardRequestTensors,
                             &received, &resp, wire::kBackwardResponseTensors);
      !s.ok()) {
    return s;
  }
  if (!resp.has_grad_input()) return HostTensor{};
  return FromWire(resp.grad_input(), received.data(1));
}

absl::StatusOr<std::string> ResolveToken(const std::string& token_file) {
  std::string token;
  if (token_file.empty()) {
    const char* env = std::getenv("GRADWIRE_TOKEN");
    return env ? std::string(env) : std::string();
  }
  std::ifstream in(token_file);
  std::getline(in, token);
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", token_file, ": the first line holds no token"));
  }
  return token;
}

std::unique_ptr<TrainStream> Client::OpenTrainStream() {
  std::unique_ptr<TrainStream> t(new TrainStream());
  t->wire_dtype_ = options_.wire_dtype;
  if (!options_.token.empty()) t->ctx_.AddMetadata("authorization", "Bearer " + options_.token);
  t->stream_ = stub_->Train(&t->ctx_);
  return t;
}

TrainStream::~TrainStream() {
  if (stream_) {
    ctx_.TryCancel();
    stream_->Finish();
  }
}

bool TrainStream::Send(const v1::TrainRequest& request) {
  return !writes_done_ && stream_->Write(request);
}

bool TrainStream::SendForward(uint64_t request_id, const std::string& module_id,
                              const HostTensor& input, bool training) {
  v1::TrainRequest req;
  req.set_request_id(request_id);
  v1::ForwardRequest* f = req.mutable_forward();
  f->set_module_id(module_id);
  *f->mutable_input() = ToWire(input, wire_dtype_);
  f->set_training(training);
  f->set_output_dtype(ToProto(wire_dtype_));
  return Send(req);
}

bool TrainStream::SendBackward(uint64_t request_id, const std::string& context_id,
                               const HostTensor& grad_output, BackwardOptions options) {
  v1::TrainRequest req;
  req.set_request_id(request_id);
  v1::BackwardRequest* b = req.mutable_backward();
  b->set_context_id(context_id);
  *b->mutable_grad_output() = ToWire(grad_output, wire_dtype_);
  b->set_retain(options.retain);
  b->set_skip_grad_input(options.skip_grad_input);
  b->set_grad_input_dtype(ToProto(wire_dtype_));
  return Send(req);
}

std::optional<v1::TrainResponse> TrainStream::Read() {
  v1::TrainResponse resp;
  if (!stream_->Read(&resp)) return std::nullopt;
  return resp;
}

absl::Status TrainStream::Finish() {
  if (!writes_done_) {
    writes_done_ = true;
    stream_->WritesDone();
  }
  v1::TrainResponse drain;
  while (stream_->Read(&drain)) {
  }
  const grpc::Status s = stream_->Finish();
  stream_.reset();
  return FromGrpc("Train", s);
}

void TrainStream::Cancel() { ctx_.TryCancel(); }

absl::Status Client::ReleaseContext(const std::string& context_id) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::ReleaseContextRequest req;
  req.set_context_id(context_id);
  (void)TakeContext(context_id, /*keep=*/false);
  v1::ReleaseContextResponse resp;
  return FromGrpc("ReleaseContext", stub_->ReleaseContext(&ctx, req, &resp));
}

absl::Status Client::RegisterSharedMemory(const std::string& name, const std::string& key,
                                          uint64_t offset, uint64_t byte_size) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
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
  PrepareContext(&ctx);
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
  PrepareContext(&ctx);
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
  PrepareContext(&ctx);
  v1::ForwardResponse resp;
  if (auto s = FromGrpc("Forward", stub_->Forward(&ctx, req, &resp)); !s.ok()) return s;
  if (!resp.context_id().empty()) {
    int64_t elements = 1;
    for (int64_t d : req.input().shape()) elements *= d;
    NoteContext(resp.context_id(), elements);
  }
  return resp;
}

absl::StatusOr<v1::BackwardResponse> Client::BackwardRaw(const v1::BackwardRequest& req) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::BackwardResponse resp;
  if (auto s = FromGrpc("Backward", stub_->Backward(&ctx, req, &resp)); !s.ok()) return s;
  (void)TakeContext(req.context_id(), /*keep=*/req.retain());
  return resp;
}

absl::StatusOr<uint64_t> Client::ApplyGradients(const std::string& module_id, float learning_rate) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
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
  PrepareContext(&ctx);
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
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
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
  } else if (auto s = FromGrpc("GetWeights", stub_->GetWeights(&ctx, req, &resp)); !s.ok()) {
    return s;
  }
  auto out = FromWireNamed(resp.parameters());
  if (!out.ok()) return out.status();
  out->weight_version = resp.weight_version();
  return out;
}

absl::StatusOr<uint64_t> Client::SetWeights(
    const std::string& module_id,
    const std::vector<std::pair<std::string, HostTensor>>& parameters) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
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
  } else if (auto s = FromGrpc("SetWeights", stub_->SetWeights(&ctx, req, &resp)); !s.ok()) {
    return s;
  }
  return resp.weight_version();
}

int64_t Client::chunked_calls() const {
  std::lock_guard<std::mutex> lock(cache_mu_);
  return chunked_calls_;
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

void Client::Remember(const v1::ModuleInfo& info) {
  const v1::ModuleSpec& spec = info.spec();
  ModuleShape shape;
  shape.in = spec.in_features();
  shape.out = spec.out_features();
  shape.ffn = spec.kind() == v1::LAYERNORM_MLP ? spec.ffn_features() : 0;
  shape.layernorm_output = spec.kind() != v1::LINEAR && spec.return_layernorm_output();
  shape.gated = spec.activation() == v1::SWIGLU || spec.activation() == v1::GEGLU;
  std::lock_guard<std::mutex> lock(cache_mu_);
  modules_[info.module_id()] = shape;
}

std::optional<Client::ModuleShape> Client::Shape(const std::string& module_id) {
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (auto it = modules_.find(module_id); it != modules_.end()) return it->second;
  }
  (void)ListModules();  // fills the cache; a failure only means the size stays unknown
  std::lock_guard<std::mutex> lock(cache_mu_);
  if (auto it = modules_.find(module_id); it != modules_.end()) return it->second;
  return std::nullopt;
}

void Client::NoteContext(const std::string& context_id, int64_t grad_input_elements) {
  constexpr size_t kMaxRemembered = 1 << 16;  // contexts never consumed must not grow this forever
  std::lock_guard<std::mutex> lock(cache_mu_);
  if (!contexts_.emplace(context_id, grad_input_elements).second) return;
  context_order_.push_back(context_id);
  while (context_order_.size() > kMaxRemembered) {
    contexts_.erase(context_order_.front());
    context_order_.pop_front();
  }
}

int64_t Client::TakeContext(const std::string& context_id, bool keep) {
  std::lock_guard<std::mutex> lock(cache_mu_);
  auto it = contexts_.find(context_id);
  if (it == contexts_.end()) return -1;
  const int64_t elements = it->second;
  if (!keep) contexts_.erase(it);  // context_order_ keeps the id until it ages out: harmless
  return elements;
}

void Client::StartChunked(grpc::ClientContext* ctx) {
  PrepareContext(ctx);
  std::lock_guard<std::mutex> lock(cache_mu_);
  ++chunked_calls_;
}

absl::StatusOr<v1::ForwardResponse> Client::ForwardChunked(v1::ForwardRequest& req) {
  grpc::ClientContext ctx;
  StartChunked(&ctx);
  auto stream = stub_->ForwardChunked(&ctx);
  return CallChunked<v1::ForwardRequestPart, v1::ForwardResponsePart, v1::ForwardResponse>(
      "ForwardChunked", ctx, stream.get(), req, int64_t(options_.chunk_kib) << 10);
}

absl::StatusOr<v1::BackwardResponse> Client::BackwardChunked(v1::BackwardRequest& req) {
  grpc::ClientContext ctx;
  StartChunked(&ctx);
  auto stream = stub_->BackwardChunked(&ctx);
  return CallChunked<v1::BackwardRequestPart, v1::BackwardResponsePart, v1::BackwardResponse>(
      "BackwardChunked", ctx, stream.get(), req, int64_t(options_.chunk_kib) << 10);
}

absl::StatusOr<v1::GetWeightsResponse> Client::GetWeightsChunked(const v1::GetWeightsRequest& req) {
  grpc::ClientContext ctx;
  StartChunked(&ctx);
  auto stream = stub_->GetWeightsChunked(&ctx, req);
  return ReadToEnd<v1::GetWeightsResponsePart, v1::GetWeightsResponse>("GetWeightsChunked", ctx,
                                                                       stream.get());
}

absl::StatusOr<v1::SetWeightsResponse> Client::SetWeightsChunked(v1::SetWeightsRequest& req) {
  grpc::ClientContext ctx;
  StartChunked(&ctx);
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
