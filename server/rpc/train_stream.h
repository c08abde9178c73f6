// The Train bidi stream: pipelined forwards, backwards and releases with bounded read-ahead, each
// request through the lifecycle of call.h and the same bodies as the unary calls.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>

#include "absl/status/status.h"
#include "gradwire/v1/service.grpc.pb.h"
#include "server/rpc/call.h"

namespace gradwire::rpc {

// What a Train request runs, by kind (the service's bodies of Forward, Backward and
// ReleaseContext). The call is passed so a body can stop when it is abandoned.
struct TrainBodies {
  std::function<absl::Status(const Caller&, const v1::ForwardRequest&, v1::ForwardResponse*,
                             const CallBase&)>
      forward;
  std::function<absl::Status(const Caller&, const v1::BackwardRequest&, v1::BackwardResponse*,
                             const CallBase&)>
      backward;
  std::function<absl::Status(const Caller&, const v1::ReleaseContextRequest&)> release;
};

// `env` and `bodies` must outlive the call.
grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse>* StartTrain(
    CallEnv& env, grpc::CallbackServerContext* ctx, const TrainBodies& bodies);

}  // namespace gradwire::rpc
