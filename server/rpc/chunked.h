// The chunked RPCs: ForwardChunked, BackwardChunked, GetWeightsChunked and SetWeightsChunked.
// Each reads its request (header, then chunks placed straight into the tensors), runs it (Forward
// and Backward through the pipeline every call shape shares, the weights calls through the unary
// calls' bodies) on the device executor, and writes its response as
// header + chunks. A bad sequence finishes the call with INVALID_ARGUMENT at once and frees what
// was assembled; a forward whose response cannot be delivered releases its context. All four
// follow the lifecycle of call.h.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>

#include "absl/status/status.h"
#include "gradwire/v1/service.grpc.pb.h"
#include "server/rpc/call.h"
#include "server/rpc/request_checks.h"
#include "server/rpc/step_pipeline.h"

namespace gradwire::rpc {

// A chunked call's body, given the assembled request (its tensors' data in the message).
template <typename Req, typename Resp>
using ChunkedWork = std::function<absl::Status(const Caller&, const CallBase&, Req&, Resp*)>;

// Forward and Backward: chunked request in, chunked response out; the assembled request is a job
// of the pipeline (step_pipeline.h), batched with other calls'. `checks` judges the header before
// anything is allocated for the tensors; `env`, `checks` and `steps` must outlive the call.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StartForwardChunked(
    CallEnv& env, grpc::CallbackServerContext* ctx, const RequestChecks& checks,
    StepPipeline& steps);
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StartBackwardChunked(
    CallEnv& env, grpc::CallbackServerContext* ctx, const RequestChecks& checks,
    StepPipeline& steps);
// GetWeights: one request in, chunked response out.
grpc::ServerWriteReactor<v1::GetWeightsResponsePart>* StartGetWeightsChunked(
    CallEnv& env, grpc::CallbackServerContext* ctx, const v1::GetWeightsRequest& request,
    ChunkedWork<const v1::GetWeightsRequest, v1::GetWeightsResponse> work);
// SetWeights: chunked request in, one response (`response`, gRPC's) out.
grpc::ServerReadReactor<v1::SetWeightsRequestPart>* StartSetWeightsChunked(
    CallEnv& env, grpc::CallbackServerContext* ctx, v1::SetWeightsResponse* response,
    const RequestChecks& checks, ChunkedWork<v1::SetWeightsRequest, v1::SetWeightsResponse> work);

}  // namespace gradwire::rpc
