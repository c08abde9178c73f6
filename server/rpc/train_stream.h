// The Train bidi stream: pipelined forwards, backwards and releases with bounded read-ahead, each
// request through the lifecycle of call.h, its forwards and backwards through the same pipeline as
// the unary calls' (batched with them).
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>

#include "absl/status/status.h"
#include "gradwire/v1/service.grpc.pb.h"
#include "server/rpc/call.h"
#include "server/rpc/step_pipeline.h"

namespace gradwire::rpc {

// What a Train request runs: forwards and backwards go through the service's one pipeline
// (step_pipeline.h), in the order they came; releases run the service's ReleaseContext body.
struct TrainBodies {
  StepPipeline* steps = nullptr;
  std::function<absl::Status(const Caller&, const v1::ReleaseContextRequest&)> release;
};

// `env` and `bodies` must outlive the call.
grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse>* StartTrain(
    CallEnv& env, grpc::CallbackServerContext* ctx, const TrainBodies& bodies);

}  // namespace gradwire::rpc
