// The one pipeline of forwards and backwards. Every call shape (the unary calls, the chunked
// calls, the Train stream; shared memory rides in any of them) hands its request over as a job
// and gets the job's end back:
//
//   job -> queue -> prepare -> compute -> finish -> done
//
//   queue    With batching on, a job that others can share a core call with (forwards of one
//            module, training or not, one input dtype; backwards of one module's contexts) waits
//            in the batch former (server/rpc/scheduling/batcher.h) with the jobs of its key. Any
//            other job goes to the device executor alone.
//   prepare  Its own checks, the request's tensors gathered (shared memory or not) and cancellation
//   (steps.cc). compute  One core call for the prepared jobs of a batch (the step runner's one
//   path). A job
//            alone is a batch of one: the same steps, the same code.
//   finish   Delivery (encoding, shared-memory writes), then the job's `done`. A job alone
//            finishes on the device executor; the jobs of a batch on the control thread, so that
//            the device goes on to the next task at once.
//
// The service implements it (steps.cc); the call shapes see only this.
#pragma once

#include <functional>

#include "absl/status/status.h"
#include "gradwire/v1/service.pb.h"
#include "server/rpc/call.h"
#include "server/rpc/scheduling/batcher.h"

namespace gradwire::wire {
class ReceivedMessage;
}  // namespace gradwire::wire

namespace gradwire::rpc {

// A forward's or a backward's job, as its call shape hands it over.
template <typename Request, typename Response>
struct StepJob {
  const Request* request = nullptr;  // the call's: alive until `done` has run
  Response* response = nullptr;      // filled when `done` is told OK
  // The data of the request's tensors when it was received raw (zero_copy.h); the message's own
  // data fields are then empty.
  const wire::ReceivedMessage* raw = nullptr;
  // The job's end, called exactly once with its status (the response filled when OK): on the
  // device executor, the control thread or, for a job that never started, where it was dropped.
  // The call is held alive until it has returned.
  std::function<void(absl::Status)> done;
};
using ForwardJob = StepJob<v1::ForwardRequest, v1::ForwardResponse>;
using BackwardJob = StepJob<v1::BackwardRequest, v1::BackwardResponse>;

// Where a job goes: what its call hands to CallBase::AdmitAndRun (RunOn::kDevice).
struct StepEntry {
  std::function<void(absl::Status started)> run;
  CallBase::Submitter submit;
};

class StepPipeline {
 public:
  // A stream's jobs, which must run in the order they came (scheduling::BatchFormer::Order).
  using Order = scheduling::BatchFormer::Order;

  // The entry of `job` for `call` (authenticated; alive while it holds a reference). `order`,
  // when given, must outlive the admission (submit runs inside AdmitAndRun).
  virtual StepEntry Forward(const CallBase& call, ForwardJob job, Order* order = nullptr) = 0;
  virtual StepEntry Backward(const CallBase& call, BackwardJob job, Order* order = nullptr) = 0;

 protected:
  ~StepPipeline() = default;
};

}  // namespace gradwire::rpc
