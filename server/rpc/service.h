// The gRPC callback service: translates requests into ModuleHost calls, runs them on the device
// executor (reactors never block) and finishes each RPC from the executor with a mapped status.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gradwire/v1/service.grpc.pb.h"
#include "gradwire/wire/codec.h"
#include "gradwire/wire/zero_copy.h"
#include "server/core/checkpoint.h"
#include "server/core/executor.h"
#include "server/core/module_host.h"
#include "server/rpc/auth.h"
#include "server/rpc/call.h"
#include "server/rpc/request_id.h"
#include "server/rpc/shared_memory.h"
#include "server/rpc/usage.h"

namespace gradwire::rpc {

// One finished RPC, for logs and metrics.
struct RpcRecord {
  const char* method = "";
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string message;     // the status message (empty when OK)
  double seconds = 0;      // from arrival to status
  std::string module_id;   // from the request, where it names one
  std::string context_id;  // from the request, where it names one
  std::string tenant;      // the caller's tenant when tokens are on
  std::string client;      // whom per-client limits count against (Caller::client); empty when
                           // authentication failed
  RequestId request;       // the call's request id (request_id.h)
};

// Who is calling. Without tokens every caller sees every module (`isolated` false); with tokens
// a caller sees only its tenant's modules and contexts.
struct Caller {
  bool isolated = false;
  std::string tenant;
  // Whom per-client limits count against: the tenant with tokens, else the peer's address
  // (without its port, so reconnecting does not make a new client).
  std::string client;
};

// Request limits; each refusal is RESOURCE_EXHAUSTED naming the flag. 0: unlimited.
struct ServiceLimits {
  int64_t max_request_bytes = int64_t(64) << 20;  // serialized size of one request message
  int64_t max_tensor_elements = int64_t(1)
                                << 26;     // any tensor a call sends or makes the server build
  int64_t max_contexts_per_client = 4096;  // live training contexts of one client
  int64_t max_queued_per_module = 256;     // calls waiting on the executor, per module
  int64_t max_queued_per_client = 1024;    // calls waiting on the executor, per client
};

// Per-client quotas in bytes (a client is a tenant with tokens, else a peer host); each refusal is
// RESOURCE_EXHAUSTED naming the flag, and changes nothing. 0: unlimited. The third quota, on
// saved-context bytes, is the context store's (core::ContextLimits::client_bytes).
struct ClientQuotas {
  int64_t parameter_bytes = int64_t(8) << 30;  // fp32 parameters of the client's modules
  int64_t stream_bytes = int64_t(4) << 30;     // tensors of its chunked requests being received
};

struct ServiceOptions {
  std::string version;      // reported by GetServerInfo
  std::string device;       // "cpu" or "cuda:N"
  std::string device_name;  // human-readable description of the device
  // Persists modules on create, weight upload, delete and every N optimizer steps; null: none.
  const core::Checkpointer* checkpointer = nullptr;
  // Bearer tokens and their tenants; null: no authentication, no isolation.
  const Authenticator* authenticator = nullptr;
  // Called once per finished RPC (request-scoped logs, metrics); may be empty.
  std::function<void(const RpcRecord&)> on_rpc_done;
  // Called on the executor as a call's work (or a Train message's) starts, with how long it
  // waited in the queue (metrics); may be empty.
  std::function<void(const char* method, const std::string& client, double seconds)> on_queue_wait;
  // Test seam: called on the executor after a Forward's last check before its compute, so a test
  // can cancel or outlive a call at exactly that point; may be empty.
  std::function<void()> before_forward_compute;
  // Test seam: called on the executor after a unary call's work returned and before the call
  // finishes, so a test can cancel a call whose work is done; may be empty.
  std::function<void(const char* method, const absl::Status& status)> before_unary_finish;
  // Test seam: called on a gRPC thread when the server sees a unary call cancelled (by the client
  // or its deadline); must not block; may be empty.
  std::function<void(const char* method)> on_unary_cancel;
  // Train streams: requests read ahead of the responses written (flow control).
  int stream_read_ahead = 8;
  // Chunked calls: the size of the chunks the server sends and the largest it accepts, and the
  // most bytes the tensors of one chunked request may add up to.
  int64_t chunk_bytes = int64_t(4) << 20;
  int64_t max_stream_bytes = int64_t(4) << 30;
  ServiceLimits limits;
  ClientQuotas quotas;
  // Shared-memory tensors for clients on this host (off by default).
  SharedMemoryOptions shared_memory;
  // A training forward that finishes less than this before its deadline is treated as abandoned:
  // its response would likely reach the client after the client gave up, and the context it
  // created would then be known to nobody. It is released and the call answers CANCELLED.
  std::chrono::milliseconds delivery_slack{10};
};

// Releases contexts nobody will consume (a forward's response that never arrived, a Train
// stream's leftovers) on `executor`, in order behind the work queued there, never on the calling
// reactor thread: the context store's lock may be held across an offload copy. Logs `what` with
// what was released.
void ReleaseUnconsumed(core::DeviceExecutor& executor, core::ModuleHost& host,
                       std::vector<std::string> ids, core::ContextStore::ReleaseReason reason,
                       std::string what);

class StagingBuffer;  // service.cc

// What --max-request-bytes measures of a unary call: a parsed message's size, or a raw one's
// length; negative: nothing to check.
struct RequestSize {
  RequestSize() = default;
  RequestSize(const google::protobuf::Message* m)  // NOLINT: implicit from a request pointer
      : bytes(m != nullptr ? int64_t(m->ByteSizeLong()) : -1) {}
  explicit RequestSize(int64_t n) : bytes(n) {}
  int64_t bytes = -1;
};

// The generated service, method by method (a new RPC must be added here, or it answers
// UNIMPLEMENTED). Forward, Backward and their chunked variants are raw: their tensor bytes skip
// protobuf's copies on the way in and out (gradwire/wire/zero_copy.h), while the bytes on the wire
// are the standard encoding, so any protobuf client works.
namespace service_base {
using G = v1::Gradwire;
using Shm = G::WithCallbackMethod_RegisterSharedMemory<G::WithCallbackMethod_UnregisterSharedMemory<
    G::WithCallbackMethod_ListSharedMemory<G::Service>>>;
using Chunked = G::WithRawCallbackMethod_ForwardChunked<G::WithRawCallbackMethod_BackwardChunked<
    G::WithCallbackMethod_GetWeightsChunked<G::WithCallbackMethod_SetWeightsChunked<Shm>>>>;
using Weights = G::WithCallbackMethod_ApplyGradients<G::WithCallbackMethod_GetGradients<
    G::WithCallbackMethod_GetWeights<G::WithCallbackMethod_SetWeights<Chunked>>>>;
using Compute = G::WithRawCallbackMethod_Forward<G::WithRawCallbackMethod_Backward<
    G::WithCallbackMethod_ReleaseContext<G::WithCallbackMethod_Train<Weights>>>>;
using All = G::WithCallbackMethod_GetServerInfo<G::WithCallbackMethod_CreateModule<
    G::WithCallbackMethod_ListModules<G::WithCallbackMethod_DeleteModule<Compute>>>>;
}  // namespace service_base
using ServiceBase = service_base::All;

class GradwireService final : public ServiceBase {
 public:
  // `host` and `executor` must outlive the service.
  GradwireService(core::ModuleHost& host, core::DeviceExecutor& executor, ServiceOptions options);
  ~GradwireService() override;

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest* req,
                                          v1::GetServerInfoResponse* resp) override;
  grpc::ServerUnaryReactor* CreateModule(grpc::CallbackServerContext* ctx,
                                         const v1::CreateModuleRequest* req,
                                         v1::CreateModuleResponse* resp) override;
  grpc::ServerUnaryReactor* ListModules(grpc::CallbackServerContext* ctx,
                                        const v1::ListModulesRequest* req,
                                        v1::ListModulesResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteModule(grpc::CallbackServerContext* ctx,
                                         const v1::DeleteModuleRequest* req,
                                         v1::DeleteModuleResponse* resp) override;
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                    grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Backward(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                     grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* ReleaseContext(grpc::CallbackServerContext* ctx,
                                           const v1::ReleaseContextRequest* req,
                                           v1::ReleaseContextResponse* resp) override;
  grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse>* Train(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ApplyGradients(grpc::CallbackServerContext* ctx,
                                           const v1::ApplyGradientsRequest* req,
                                           v1::ApplyGradientsResponse* resp) override;
  grpc::ServerUnaryReactor* GetGradients(grpc::CallbackServerContext* ctx,
                                         const v1::GetGradientsRequest* req,
                                         v1::GetGradientsResponse* resp) override;
  grpc::ServerUnaryReactor* GetWeights(grpc::CallbackServerContext* ctx,
                                       const v1::GetWeightsRequest* req,
                                       v1::GetWeightsResponse* resp) override;
  grpc::ServerUnaryReactor* SetWeights(grpc::CallbackServerContext* ctx,
                                       const v1::SetWeightsRequest* req,
                                       v1::SetWeightsResponse* resp) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ForwardChunked(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* BackwardChunked(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerWriteReactor<v1::GetWeightsResponsePart>* GetWeightsChunked(
      grpc::CallbackServerContext* ctx, const v1::GetWeightsRequest* req) override;
  grpc::ServerReadReactor<v1::SetWeightsRequestPart>* SetWeightsChunked(
      grpc::CallbackServerContext* ctx, v1::SetWeightsResponse* resp) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(grpc::CallbackServerContext* ctx,
                                                 const v1::RegisterSharedMemoryRequest* req,
                                                 v1::RegisterSharedMemoryResponse* resp) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* ctx, const v1::UnregisterSharedMemoryRequest* req,
      v1::UnregisterSharedMemoryResponse* resp) override;
  grpc::ServerUnaryReactor* ListSharedMemory(grpc::CallbackServerContext* ctx,
                                             const v1::ListSharedMemoryRequest* req,
                                             v1::ListSharedMemoryResponse* resp) override;

  // Train-stream requests read so far, streams open now (tests, metrics).
  int64_t stream_requests_read() const { return stream_requests_read_.load(); }
  int64_t streams_open() const { return streams_open_.load(); }
  // Calls counted against --max-queued-per-module for `module_id` that have not started yet.
  int64_t queued_calls(const std::string& module_id) const;
  // Every client that holds anything now, against its quotas.
  std::vector<ClientUsage> Usage() const;
  // Calls alive now (admitted or not, until gRPC's OnDone and the last queued work), for tests.
  static int64_t live_calls();
  // Shared-memory regions registered now, all clients (tests, metrics).
  int64_t shared_memory_regions() const { return shared_memory_.regions(); }

 private:
  friend class CallBase;
  friend class Admission;
  friend class UnaryCall;
  friend class TrainCall;
  template <typename Req, typename ReqPart, typename Resp, typename RespPart>
  friend class ChunkedBidiCall;
  friend class SetWeightsChunkedCall;
  friend class GetWeightsChunkedCall;
  template <typename Req, typename ReqPart>
  friend class PartReader;
  using Work = std::function<absl::Status(const Caller&, const CallBase&)>;

  // The bodies of Forward, Backward and ReleaseContext, shared by the unary calls, the chunked
  // calls and Train. `call` (may be null) is checked before the compute, and for a training
  // forward after it too: an abandoned forward leaves no context behind.
  // `raw`, when given, holds the data of the request's tensors (received without protobuf's
  // copy); the message's own data fields are then empty.
  absl::Status DoForward(const Caller& caller, const v1::ForwardRequest& req,
                         v1::ForwardResponse* resp, const CallBase* call,
                         const wire::ReceivedMessage* raw = nullptr);
  absl::Status DoBackward(const Caller& caller, const v1::BackwardRequest& req,
                          v1::BackwardResponse* resp, const CallBase* call,
                          const wire::ReceivedMessage* raw = nullptr);
  absl::Status DoRelease(const Caller& caller, const v1::ReleaseContextRequest& req);
  // The bodies of GetWeights and SetWeights, shared with their chunked variants.
  absl::Status DoGetWeights(const Caller& caller, const v1::GetWeightsRequest& req,
                            v1::GetWeightsResponse* resp);
  absl::Status DoSetWeights(const Caller& caller, const v1::SetWeightsRequest& req,
                            v1::SetWeightsResponse* resp);
  // --max-tensor-elements on what a forward sends and would build, the module's input width, and
  // --max-contexts-per-client and the context quota for a training forward: checked before
  // anything runs (and before a chunked request allocates).
  absl::Status CheckForwardLimits(const Caller& caller, const v1::ForwardRequest& req) const;
  // What a chunked request's header allows checking before its tensors are allocated: the ids, the
  // ownership, the shapes against the module and the element limits.
  absl::Status CheckHeader(const Caller& caller, const v1::ForwardRequest& req) const;
  absl::Status CheckHeader(const Caller& caller, const v1::BackwardRequest& req) const;
  absl::Status CheckHeader(const Caller& caller, const v1::SetWeightsRequest& req) const;

  // Shared-memory tensors. `t` itself when it carries its bytes; else its header checked (bytes
  // called for, --max-tensor-elements) before its bytes are read from the caller's region into
  // a staging buffer, whose view is returned.
  absl::StatusOr<wire::TensorView> Stage(const Caller& caller, const v1::Tensor& t,
                                         absl::string_view field, StagingBuffer* staged,
                                         const wire::ReceivedMessage* raw, int raw_field) const;
  // Moves an encoded result into `out`: into the response, or with `ref` set (has_ref), into the
  // caller's region, `out` then carrying the header and where the bytes went.
  absl::Status Deliver(const Caller& caller, bool has_ref, const v1::SharedMemoryRef& ref,
                       absl::string_view field, wire::EncodedTensor&& e, v1::Tensor* out) const;

  // A unary call through the lifecycle of call.h: authenticated, measured against
  // --max-request-bytes (`request`, when given), admitted for `module_id` / `context_id`, then
  // `work` runs on the device executor (on the control thread when `control`). `created_context`,
  // when given, names the context a successful `work` created (read after it returns): when its
  // response never reaches the client, the call's end releases it, since nobody holds its id.
  grpc::ServerUnaryReactor* RunUnary(grpc::CallbackServerContext* ctx, const char* method,
                                     Work work, std::string module_id = {},
                                     std::string context_id = {}, RequestSize request = {},
                                     std::function<std::string()> created_context = nullptr,
                                     bool control = false);

  // RESOURCE_EXHAUSTED naming --max-request-bytes when `request` is over it.
  absl::Status CheckRequestBytes(int64_t bytes) const;
  // Step 2 of a call: ownership, then the queue bounds. A call naming a module must name one the
  // caller may see (NOT_FOUND otherwise, before anything is counted); a call naming a context
  // counts for that context's module only when the caller may see the context. Every call counts
  // for its client (--max-queued-per-client). RESOURCE_EXHAUSTED naming the flag when full.
  absl::Status Admit(const Caller& caller, const std::string& module_id,
                     const std::string& context_id, Admission* admission);
  void Dequeued(const std::string& module_key, const std::string& client_key);

  // Chunked bytes in flight per client (--max-stream-bytes-per-client): reserved when a header is
  // accepted, returned when the request is dropped.
  absl::Status ReserveStreamBytes(const Caller& caller, int64_t bytes);
  void ReturnStreamBytes(const std::string& client, int64_t bytes);

  absl::StatusOr<Caller> Authenticate(const grpc::CallbackServerContext* ctx) const;
  // INVALID_ARGUMENT for a malformed id; NOT_FOUND (as for an unknown id) when the caller's tenant
  // does not own it.
  absl::Status CheckModule(const Caller& caller, const std::string& module_id) const;
  absl::Status CheckContext(const Caller& caller, const std::string& context_id) const;
  // Logs and metrics of one finished call; ids are bounded and escaped here.
  void Report(const char* method, const absl::Status& status, double seconds,
              const std::string& module_id, const std::string& context_id, const Caller& caller,
              const RequestId& request) const;

  // Saves a module's checkpoint when checkpoints are on; a failure is logged, not returned (the
  // call itself succeeded, and the next save retries).
  void Persist(const std::string& module_id) const;

  core::ModuleHost& host_;
  core::DeviceExecutor& executor_;
  const ServiceOptions options_;
  SharedMemoryRegistry shared_memory_;  // closes every region when the service goes
  const std::string instance_id_;       // GetServerInfo: new in every process
  // Module creation and deletion: host memory only, so it runs here, off the device executor, and
  // a big module cannot stall other clients' compute.
  std::unique_ptr<core::DeviceExecutor> control_;
  std::atomic<int64_t> stream_requests_read_{0};
  std::atomic<int64_t> streams_open_{0};
  mutable std::mutex queue_mu_;                                // guards the three maps below
  std::unordered_map<std::string, int64_t> queued_;            // module -> calls not started
  std::unordered_map<std::string, int64_t> queued_by_client_;  // client -> calls not started
  std::unordered_map<std::string, int64_t> stream_bytes_;      // client -> chunked bytes held
  // fp32 parameter bytes per client (--max-parameter-bytes-per-client), reserved before a module
  // is created; and who holds each module's bytes.
  std::unordered_map<std::string, int64_t> parameter_bytes_;
  std::unordered_map<std::string, std::pair<std::string, int64_t>> module_bytes_;
};

}  // namespace gradwire::rpc
