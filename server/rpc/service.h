// The gRPC callback service: translates requests into ModuleHost calls, runs them on the device
// executor (reactors never block) and finishes each RPC from the executor with a mapped status.
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gradwire/v1/service.grpc.pb.h"
#include "server/core/checkpoint.h"
#include "server/core/executor.h"
#include "server/core/module_host.h"
#include "server/rpc/auth.h"

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
  // Test seam: called on the executor after a Forward's last check before its compute, so a test
  // can cancel or outlive a call at exactly that point; may be empty.
  std::function<void()> before_forward_compute;
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
};

// Releases contexts nobody will consume (a forward's response that never arrived, a Train
// stream's leftovers) on `executor`, in order behind the work queued there, never on the calling
// reactor thread: the context store's lock may be held across an offload copy. Logs `what` with
// what was released.
void ReleaseUnconsumed(core::DeviceExecutor& executor, core::ModuleHost& host,
                       std::vector<std::string> ids, core::ContextStore::ReleaseReason reason,
                       std::string what);

class TrainReactor;
template <typename Req, typename ReqPart, typename Resp, typename RespPart>
class ChunkedBidiReactor;
class SetWeightsChunkedReactor;
class GetWeightsChunkedReactor;

class GradwireService final : public v1::Gradwire::CallbackService {
 public:
  // `host` and `executor` must outlive the service.
  GradwireService(core::ModuleHost& host, core::DeviceExecutor& executor, ServiceOptions options);

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
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const v1::ForwardRequest* req,
                                    v1::ForwardResponse* resp) override;
  grpc::ServerUnaryReactor* Backward(grpc::CallbackServerContext* ctx,
                                     const v1::BackwardRequest* req,
                                     v1::BackwardResponse* resp) override;
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
  grpc::ServerBidiReactor<v1::ForwardRequestPart, v1::ForwardResponsePart>* ForwardChunked(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerBidiReactor<v1::BackwardRequestPart, v1::BackwardResponsePart>* BackwardChunked(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerWriteReactor<v1::GetWeightsResponsePart>* GetWeightsChunked(
      grpc::CallbackServerContext* ctx, const v1::GetWeightsRequest* req) override;
  grpc::ServerReadReactor<v1::SetWeightsRequestPart>* SetWeightsChunked(
      grpc::CallbackServerContext* ctx, v1::SetWeightsResponse* resp) override;

  // Train-stream requests read so far, streams open now (tests, metrics).
  int64_t stream_requests_read() const { return stream_requests_read_.load(); }
  int64_t streams_open() const { return streams_open_.load(); }
  // Calls counted against --max-queued-per-module for `module_id` that have not started yet.
  int64_t queued_calls(const std::string& module_id) const;

 private:
  friend class TrainReactor;
  template <typename Req, typename ReqPart, typename Resp, typename RespPart>
  friend class ChunkedBidiReactor;
  friend class SetWeightsChunkedReactor;
  friend class GetWeightsChunkedReactor;

  // The bodies of Forward, Backward and ReleaseContext, shared by the unary calls and Train.
  // `ctx` (may be null) is checked before the compute, and for a forward after it too: a
  // cancelled or timed-out forward leaves no context behind.
  absl::Status DoForward(const Caller& caller, const v1::ForwardRequest& req,
                         v1::ForwardResponse* resp, const grpc::CallbackServerContext* ctx);
  absl::Status DoBackward(const Caller& caller, const v1::BackwardRequest& req,
                          v1::BackwardResponse* resp, const grpc::CallbackServerContext* ctx);
  absl::Status DoRelease(const Caller& caller, const v1::ReleaseContextRequest& req);
  // The bodies of GetWeights and SetWeights, shared with their chunked variants.
  absl::Status DoGetWeights(const Caller& caller, const v1::GetWeightsRequest& req,
                            v1::GetWeightsResponse* resp);
  absl::Status DoSetWeights(const Caller& caller, const v1::SetWeightsRequest& req,
                            v1::SetWeightsResponse* resp);
  // --max-tensor-elements on what a forward sends and would build, and
  // --max-contexts-per-client for a training forward: checked before anything runs.
  absl::Status CheckForwardLimits(const Caller& caller, const v1::ForwardRequest& req) const;

  // Queues `work` on the device executor and finishes the RPC with its status. Exceptions from
  // `work` become INTERNAL; a call cancelled before it starts is not run.
  // `module_id` / `context_id` name what the request is about, for the RpcRecord.
  // The caller is authenticated first (in the reactor); an unauthenticated call never queues,
  // nor does one over --max-request-bytes (`request`, when given, is measured) or one whose module
  // has --max-queued-per-module calls waiting already.
  // `created_context`, when given, names the context a successful `work` created (read after it
  // returns): when its response never reaches the client (cancelled, deadline, broken
  // connection), the call's end releases it, since nobody holds its id.
  grpc::ServerUnaryReactor* RunOnDevice(grpc::CallbackServerContext* ctx, const char* method,
                                        std::function<absl::Status(const Caller&)> work,
                                        std::string module_id = {}, std::string context_id = {},
                                        const google::protobuf::Message* request = nullptr,
                                        std::function<std::string()> created_context = nullptr);

  // RESOURCE_EXHAUSTED naming --max-request-bytes when `request` is over it.
  absl::Status CheckRequestBytes(const google::protobuf::Message& request) const;
  // Per-module queue depth, for every call that waits on the executor (unary, chunked and each
  // Train stream message). Admit counts a call in for the module it names, or for the module of
  // the context it names when the caller may see that context; RESOURCE_EXHAUSTED naming
  // --max-queued-per-module when that module has the limit waiting already. `key` gets what to
  // pass to Dequeued when the call starts (empty: nothing was counted).
  absl::Status AdmitQueued(const Caller& caller, const std::string& module_id,
                           const std::string& context_id, std::string* key);
  void Dequeued(const std::string& module_id);

  absl::StatusOr<Caller> Authenticate(const grpc::CallbackServerContext* ctx) const;
  // NOT_FOUND (as for an unknown id) when the caller's tenant does not own the id.
  absl::Status CheckModule(const Caller& caller, const std::string& module_id) const;
  absl::Status CheckContext(const Caller& caller, const std::string& context_id) const;
  void Report(const char* method, const absl::Status& status, double seconds,
              const std::string& module_id, const std::string& context_id,
              const std::string& tenant) const;

  // Saves a module's checkpoint when checkpoints are on; a failure is logged, not returned (the
  // call itself succeeded, and the next save retries).
  void Persist(const std::string& module_id) const;

  core::ModuleHost& host_;
  core::DeviceExecutor& executor_;
  const ServiceOptions options_;
  std::atomic<int64_t> stream_requests_read_{0};
  std::atomic<int64_t> streams_open_{0};
  mutable std::mutex queue_mu_;
  std::unordered_map<std::string, int64_t> queued_;  // module_id -> calls not yet started
};

}  // namespace gradwire::rpc
