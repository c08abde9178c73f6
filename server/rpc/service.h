// The gRPC callback service: registers one handler per RPC and translates each request into
// ModuleHost calls. The handlers run through the call lifecycle (call.h), on the device executor
// for compute (reactors never block), and finish each RPC from there with a mapped status.
//
// The service keeps the methods and is given its collaborators:
//   CallEnv        the lifecycle's steps that are the service's, as the call objects see them
//   QuotaBook      per-client and per-module counts under their own lock (quota_book.h)
//   RequestTensors a request's tensors gathered, results delivered, shared memory or not
//                  (shared_memory.h)
//   RequestChecks  what a request may ask for, before anything runs (request_checks.h)
//   spec_convert   the module spec between the wire and the core (spec_convert.h)
// and the call shapes: unary (call.h), chunked (chunked.h) and the Train stream
// (train_stream.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradwire/v1/service.grpc.pb.h"
#include "gradwire/wire/zero_copy.h"
#include "server/core/module_host.h"
#include "server/rpc/auth.h"
#include "server/rpc/call.h"
#include "server/rpc/options.h"
#include "server/rpc/quota_book.h"
#include "server/rpc/request_checks.h"
#include "server/rpc/request_id.h"
#include "server/rpc/scheduling/batcher.h"
#include "server/rpc/scheduling/executor.h"
#include "server/rpc/shared_memory.h"
#include "server/rpc/step_pipeline.h"
#include "server/rpc/train_stream.h"
#include "server/rpc/usage.h"

namespace gradwire::rpc {

// The generated service, method by method (a new RPC must be added here, or it answers
// UNIMPLEMENTED). Forward, Backward and their chunked variants are raw: their tensor bytes skip
// protobuf's copies on the way in and out (gradwire/wire/zero_copy.h), while the bytes on the wire
// are the standard encoding, so any protobuf client works.
namespace service_base {
using G = v1::Gradwire;
using Shm = G::WithCallbackMethod_CreateSharedMemory<
    G::WithCallbackMethod_RegisterSharedMemory<G::WithCallbackMethod_UnregisterSharedMemory<
        G::WithCallbackMethod_ListSharedMemory<G::Service>>>>;
using Chunked = G::WithRawCallbackMethod_ForwardChunked<G::WithRawCallbackMethod_BackwardChunked<
    G::WithCallbackMethod_GetWeightsChunked<G::WithCallbackMethod_SetWeightsChunked<Shm>>>>;
using Weights = G::WithCallbackMethod_ApplyGradients<G::WithCallbackMethod_GetGradients<
    G::WithCallbackMethod_GetWeights<G::WithCallbackMethod_SetWeights<Chunked>>>>;
using Compute = G::WithRawCallbackMethod_Forward<G::WithRawCallbackMethod_Backward<
    G::WithCallbackMethod_ReleaseContext<G::WithCallbackMethod_Train<Weights>>>>;
using All = G::WithCallbackMethod_GetServerInfo<
    G::WithCallbackMethod_CreateModule<G::WithCallbackMethod_ListModules<
        G::WithCallbackMethod_DeleteModule<G::WithCallbackMethod_KeepAlive<Compute>>>>>;
}  // namespace service_base
using ServiceBase = service_base::All;

class GradwireService final : public ServiceBase, private StepPipeline {
 public:
  // `host` and `executor` must outlive the service.
  GradwireService(core::ModuleHost& host, scheduling::DeviceExecutor& executor,
                  ServiceOptions options);
  ~GradwireService() override;

  using Ctx = grpc::CallbackServerContext;
  using Unary = grpc::ServerUnaryReactor;
  using RawBidi = grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>;

  Unary* GetServerInfo(Ctx* ctx, const v1::GetServerInfoRequest* req,
                       v1::GetServerInfoResponse* resp) override;
  Unary* CreateModule(Ctx* ctx, const v1::CreateModuleRequest* req,
                      v1::CreateModuleResponse* resp) override;
  Unary* ListModules(Ctx* ctx, const v1::ListModulesRequest* req,
                     v1::ListModulesResponse* resp) override;
  Unary* DeleteModule(Ctx* ctx, const v1::DeleteModuleRequest* req,
                      v1::DeleteModuleResponse* resp) override;
  Unary* KeepAlive(Ctx* ctx, const v1::KeepAliveRequest* req, v1::KeepAliveResponse* resp) override;
  Unary* Forward(Ctx* ctx, const grpc::ByteBuffer* req, grpc::ByteBuffer* resp) override;
  Unary* Backward(Ctx* ctx, const grpc::ByteBuffer* req, grpc::ByteBuffer* resp) override;
  Unary* ReleaseContext(Ctx* ctx, const v1::ReleaseContextRequest* req,
                        v1::ReleaseContextResponse* resp) override;
  grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse>* Train(Ctx* ctx) override;
  Unary* ApplyGradients(Ctx* ctx, const v1::ApplyGradientsRequest* req,
                        v1::ApplyGradientsResponse* resp) override;
  Unary* GetGradients(Ctx* ctx, const v1::GetGradientsRequest* req,
                      v1::GetGradientsResponse* resp) override;
  Unary* GetWeights(Ctx* ctx, const v1::GetWeightsRequest* req,
                    v1::GetWeightsResponse* resp) override;
  Unary* SetWeights(Ctx* ctx, const v1::SetWeightsRequest* req,
                    v1::SetWeightsResponse* resp) override;
  RawBidi* ForwardChunked(Ctx* ctx) override;
  RawBidi* BackwardChunked(Ctx* ctx) override;
  grpc::ServerWriteReactor<v1::GetWeightsResponsePart>* GetWeightsChunked(
      Ctx* ctx, const v1::GetWeightsRequest* req) override;
  grpc::ServerReadReactor<v1::SetWeightsRequestPart>* SetWeightsChunked(
      Ctx* ctx, v1::SetWeightsResponse* resp) override;
  Unary* CreateSharedMemory(Ctx* ctx, const v1::CreateSharedMemoryRequest* req,
                            v1::CreateSharedMemoryResponse* resp) override;
  Unary* RegisterSharedMemory(Ctx* ctx, const v1::RegisterSharedMemoryRequest* req,
                              v1::RegisterSharedMemoryResponse* resp) override;
  Unary* UnregisterSharedMemory(Ctx* ctx, const v1::UnregisterSharedMemoryRequest* req,
                                v1::UnregisterSharedMemoryResponse* resp) override;
  Unary* ListSharedMemory(Ctx* ctx, const v1::ListSharedMemoryRequest* req,
                          v1::ListSharedMemoryResponse* resp) override;

  // Train-stream requests read so far, streams open now (tests, metrics).
  int64_t stream_requests_read() const { return env_.stream_requests_read.load(); }
  int64_t streams_open() const { return env_.streams_open.load(); }
  // Requests waiting in open batches (0 without batching); tests.
  int64_t batched_waiting() const;
  // Calls counted against --max-queued-per-module for `module_id` that have not started yet.
  int64_t queued_calls(const std::string& module_id) const {
    return quotas_.queued_calls(module_id);
  }
  // Every client that holds anything now, against its quotas.
  std::vector<ClientUsage> Usage() const;
  // Calls alive now (admitted or not, until gRPC's OnDone and the last queued work), for tests.
  static int64_t live_calls() { return CallBase::live_calls(); }
  // Shared-memory regions registered now, all clients (tests, metrics).
  int64_t shared_memory_regions() const { return shared_memory_.regions(); }
  uint64_t shared_memory_bytes() const { return shared_memory_.created_bytes(); }
  // Closes the regions CreateSharedMemory made that went unused for --shared-memory-idle (the
  // server's janitor calls it).
  int CloseIdleSharedMemory() { return shared_memory_.CloseIdle(); }
  // Releases the modules whose owner made no call that succeeded and sent no keep-alive for
  // --module-ttl (a module with a call of its owner queued or running stays), with their contexts
  // and quota (none when every module is durable: --checkpoint-dir); the janitor calls it. Returns
  // how many.
  int ExpireIdleModules();
  // The module TTL in force (GetServerInfo.module_ttl_s): 0 when off or every module is durable.
  double module_ttl_s() const;
  // With a shared checkpoint directory: lets go of the modules another server took over since
  // (their claims superseded), with their contexts; the janitor calls it. Returns how many.
  int LetGoOfMovedModules();
  // With a shared checkpoint directory: queues the hand-overs other servers asked this one for
  // (HandOver::Requests, core/checkpoints/handover.h) behind the work already queued on the device
  // executor, where each saves its module, drops it and releases its claim; the hand-over watcher
  // calls it. Returns how many it queued.
  int HandOverRequested();

 private:
  // The one pipeline of forwards and backwards (step_pipeline.h, steps.cc): every call shape's
  // job is prepared, computed with its batch (alone: a batch of one) and finished by these.
  StepEntry Forward(const CallBase& call, ForwardJob job, Order* order) override;
  StepEntry Backward(const CallBase& call, BackwardJob job, Order* order) override;
  // A job on its way: what its call handed over, and what passes between its steps.
  template <typename Step>
  struct Job;
  // What a forward and a backward differ in (steps.cc).
  struct ForwardStep;
  struct BackwardStep;
  // A job for `call`, and where it goes (Forward and Backward).
  template <typename Step>
  StepEntry Enter(const CallBase& call, StepJob<typename Step::Request, typename Step::Response> in,
                  Order* order);
  // The queue: the batch former for a job that can share a batch, else the device executor.
  template <typename Step>
  // `module`: the one the job's call was admitted for (CallBase::Submitter's).
  void Submit(const std::shared_ptr<Job<Step>>& job, std::function<void()> task, Order* order,
              const std::string& module);
  // On the device executor: prepares the job, then, when it is alone, computes and finishes it.
  template <typename Step>
  void RunJob(const std::shared_ptr<Job<Step>>& job, absl::Status started);
  // A batch the batch former runs: each member prepared, one compute, each finished.
  template <typename Step>
  void RunBatch(std::vector<scheduling::BatchFormer::Member>& members,
                scheduling::BatchFormer::Run& run);
  template <typename Step>
  void Compute(const std::vector<std::shared_ptr<Job<Step>>>& ready, bool alone);
  template <typename Step>
  void FinishJob(const std::shared_ptr<Job<Step>>& job, typename Step::Output out);
  // The job's end: its `done`, once, then the call is let go.
  template <typename Step>
  static void End(const std::shared_ptr<Job<Step>>& job, absl::Status status);
  // The unary Forward and Backward: the request is parsed here, as gRPC parses a protobuf request
  // before its handler, its tensors' bytes left in the received slices (copied once when they
  // span several); the response leaves with its tensors' bytes moved, not copied.
  template <typename Step>
  Unary* StepCall(Ctx* ctx, const grpc::ByteBuffer* req, grpc::ByteBuffer* resp);

  // A job's two halves around the compute: everything up to it (checks, gathering the tensors) into
  // `p`, and everything after it (delivery, the response) from the compute's result.
  struct PreparedForward {
    core::WireForwardRequest f;
    // The input's bytes, when they lie in shared memory (a gather buffer returns to the pool of
    // the thread that frees it: the pipeline frees it on the executor, after the compute).
    std::unique_ptr<GatherBuffer> gathered = std::make_unique<GatherBuffer>();
    double transfer = 0;  // seconds spent moving tensors (not the server's compute)
    std::chrono::steady_clock::time_point start;
  };
  absl::Status PrepareForward(const Caller& caller, const v1::ForwardRequest& req,
                              const CallBase& call, const wire::ReceivedMessage* raw,
                              PreparedForward* p);
  absl::Status FinishForward(const Caller& caller, const v1::ForwardRequest& req,
                             v1::ForwardResponse* resp, const CallBase& call, PreparedForward& p,
                             absl::StatusOr<core::WireForwardOutput> computed);
  struct PreparedBackward {
    // The context's module as the call's admission found it (its ownership and route checked
    // there), empty when it found none: set when the job is queued.
    std::string admitted_module;
    core::WireBackwardRequest in;
    // The gradients' bytes, when they lie in shared memory (freed on the executor).
    std::unique_ptr<GatherBuffer> gathered = std::make_unique<GatherBuffer>();
    std::unique_ptr<GatherBuffer> gathered_ln = std::make_unique<GatherBuffer>();
    double transfer = 0;  // seconds spent moving tensors (not the server's compute)
    std::chrono::steady_clock::time_point start;
  };
  absl::Status PrepareBackward(const Caller& caller, const v1::BackwardRequest& req,
                               const CallBase& call, const wire::ReceivedMessage* raw,
                               PreparedBackward* p);
  absl::Status FinishBackward(const Caller& caller, const v1::BackwardRequest& req,
                              v1::BackwardResponse* resp, PreparedBackward& p,
                              absl::StatusOr<std::optional<wire::EncodedTensor>> computed);
  absl::Status DoRelease(const Caller& caller, const v1::ReleaseContextRequest& req);
  // The bodies of GetWeights and SetWeights, shared with their chunked variants.
  absl::Status DoGetWeights(const Caller& caller, const v1::GetWeightsRequest& req,
                            v1::GetWeightsResponse* resp);
  absl::Status DoSetWeights(const Caller& caller, const v1::SetWeightsRequest& req,
                            v1::SetWeightsResponse* resp);

  // Saves a module's checkpoint when checkpoints are on; a failure is logged, not returned (the
  // call itself succeeded, and the next save retries). A module another server holds now is
  // let go of (LetGo) instead.
  void Persist(const std::string& module_id);
  // Before a call changes or deletes a module's state: the refusal when another server holds it
  // now (it is then let go of here), else OK.
  absl::Status CheckStillHeld(const std::string& module_id);
  // Drops a module another server holds now, with its contexts (their backwards are told it
  // moved) and its quota; its checkpoint files stay, they are the new holder's.
  void LetGo(const std::string& module_id, const absl::Status& why);
  // Drops a module that moved to another server, with its contexts (told it moved) and its
  // quota: how many live contexts it had, or nothing when it was dropped already.
  std::optional<int64_t> DropMoved(const std::string& module_id);
  // On the device executor, so no step of the module runs meanwhile: saves it (everything it did
  // here), drops it with its contexts and quota, then releases its claim to the server that asked.
  void HandOver(const std::string& module_id);

  core::ModuleHost& host_;
  const ServiceOptions options_;
  SharedMemoryRegistry shared_memory_;  // closes every region when the service goes
  const RequestTensors request_tensors_;
  const std::string instance_id_;  // GetServerInfo: new in every process
  QuotaBook quotas_;
  const TrainBodies train_;
  const RequestChecks checks_;
  std::unique_ptr<scheduling::BatchFormer> batcher_;  // null unless batching is on
  // Last: destroyed first, it joins the control thread, so a creation still running there
  // finishes against a live service.
  CallEnv env_;
};

}  // namespace gradwire::rpc
