// The one pipeline of forwards and backwards (step_pipeline.h): every call shape's job is queued
// (the batch former or the device executor), prepared (checks, gathering the tensors: everything up
// to the compute), computed with its batch as one core call (a job alone is a batch of one) and
// finished (delivery, the response). The unary calls, the chunked calls and the Train stream differ
// only in how they hand a job over and what its end does. Also ReleaseContext.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gradwire/wire/tensor.h"
#include "server/common/status_macros.h"
#include "server/rpc/boundary.h"
#include "server/rpc/service.h"
#include "server/rpc/service_util.h"

namespace gradwire::rpc {
namespace {

// Adds the seconds of its scope to `total`: shared-memory copies are transport, like protobuf
// parsing, and stay out of a call's server_seconds.
class TransferTimer {
 public:
  explicit TransferTimer(double& total) : total_(total) {}
  ~TransferTimer() {
    total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  double& total_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A batch's first half (docs/batching.md): runs each member's queued work up to its compute (its
// checks and cancellation; a member answered there drops out) and returns the members still
// waiting for the compute. With yielding on, it stops after the member it is on when another
// client's work waits, and gives the members not started back to the batch former.
template <typename Slot>
std::vector<std::shared_ptr<Slot>> PrepareMembers(
    std::vector<scheduling::BatchFormer::Member>& members, scheduling::BatchFormer::Run& run) {
  std::vector<std::shared_ptr<Slot>> ready;
  ready.reserve(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    auto s = std::static_pointer_cast<Slot>(members[i].item);
    std::function<void()> task = std::move(s->task);
    s->task = nullptr;
    task();
    if (s->ready) ready.push_back(std::move(s));
    if (i + 1 < members.size() && run.OthersWaiting()) {
      run.GiveBack(members, i + 1);
      break;
    }
  }
  return ready;
}

}  // namespace

absl::Status GradwireService::PrepareForward(const Caller& caller, const v1::ForwardRequest& req,
                                             const CallBase& call, const wire::ReceivedMessage* raw,
                                             PreparedForward* p) {
  p->start = std::chrono::steady_clock::now();
  GW_RETURN_IF_ERROR(env_.CheckModule(caller, req.module_id()));
  if (!req.has_input()) return absl::InvalidArgumentError("input is required");
  GW_ASSIGN_OR_RETURN(const wire::DType output_dtype,
                      wire::OutputDType(req.output_dtype(), "output_dtype"));
  const std::string owner = RegionOwner(caller);
  // Malformed tensors are INVALID_ARGUMENT first; the limits apply to well-formed ones.
  core::WireForwardRequest& f = p->f;
  {
    TransferTimer timer(p->transfer);
    GW_ASSIGN_OR_RETURN(
        f.input, request_tensors_.Gather(owner, req.input(), "input", p->gathered.get(), raw, 2));
  }
  GW_RETURN_IF_ERROR(checks_.CheckForward(caller, req));
  f.training = req.training();
  if (!req.context_id().empty() && host_.contexts().Known(req.context_id())) {
    return absl::AlreadyExistsError(absl::StrCat("context_id ", req.context_id(),
                                                 " is or was a context already: draw another"));
  }
  f.context_id = req.context_id();  // checked above: training only, well-formed, not taken
  f.output_dtype = output_dtype;
  if (req.has_output_shared_memory() || req.has_layernorm_output_shared_memory()) {
    // Room for the results, checked before the compute: rows x out_features (and x in_features).
    GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(req.module_id()));
    const uint64_t rows = uint64_t(f.input.numel() / std::max<int64_t>(1, f.input.shape.back()));
    const uint64_t element = uint64_t(wire::ElementSize(output_dtype));
    if (req.has_output_shared_memory()) {
      GW_RETURN_IF_ERROR(request_tensors_.CheckRoom(owner, req.output_shared_memory(),
                                                    "output_shared_memory",
                                                    rows * uint64_t(spec.out_features) * element));
    }
    if (req.has_layernorm_output_shared_memory()) {
      GW_RETURN_IF_ERROR(request_tensors_.CheckRoom(owner, req.layernorm_output_shared_memory(),
                                                    "layernorm_output_shared_memory",
                                                    rows * uint64_t(spec.in_features) * element));
    }
  }
  f.client = caller.client;
  if (call.Abandoned()) {  // stop before the compute
    return absl::CancelledError("Forward was cancelled or passed its deadline; nothing was run");
  }
  if (options_.before_forward_compute) options_.before_forward_compute();
  return absl::OkStatus();
}

absl::Status GradwireService::FinishForward(const Caller& caller, const v1::ForwardRequest& req,
                                            v1::ForwardResponse* resp, const CallBase& call,
                                            PreparedForward& p,
                                            absl::StatusOr<core::WireForwardOutput> computed) {
  GW_RETURN_IF_ERROR(computed.status());
  core::WireForwardOutput& out = *computed;
  const std::string owner = RegionOwner(caller);
  // A context is only worth returning when the response can still reach the client in time.
  if (!out.context_id.empty() && call.Abandoned(options_.delivery_slack)) {
    (void)host_.ReleaseContext(out.context_id, core::ContextStore::ReleaseReason::kUndelivered);
    return absl::CancelledError(
        "Forward was cancelled, passed its deadline or came too close to it during the compute; "
        "its context was released");
  }
  absl::Status delivered;
  {
    TransferTimer timer(p.transfer);
    delivered = request_tensors_.Deliver(owner, req.has_output_shared_memory(),
                                         req.output_shared_memory(), "output_shared_memory",
                                         std::move(out.output), resp->mutable_output());
    if (delivered.ok() && out.has_layernorm_output) {
      delivered = request_tensors_.Deliver(
          owner, req.has_layernorm_output_shared_memory(), req.layernorm_output_shared_memory(),
          "layernorm_output_shared_memory", std::move(out.layernorm_output),
          resp->mutable_layernorm_output());
    }
  }
  if (!delivered.ok()) {  // a region its owner shrank meanwhile: nobody will get the context
    if (!out.context_id.empty()) (void)host_.ReleaseContext(out.context_id);
    return delivered;
  }
  resp->set_context_id(out.context_id);
  resp->set_weight_version(out.weight_version);
  resp->set_batch_requests(out.batch_requests);
  resp->set_server_seconds(SecondsSince(p.start) - p.transfer);
  return absl::OkStatus();
}

absl::Status GradwireService::PrepareBackward(const Caller& caller, const v1::BackwardRequest& req,
                                              const CallBase& call,
                                              const wire::ReceivedMessage* raw,
                                              PreparedBackward* p) {
  p->start = std::chrono::steady_clock::now();
  GW_RETURN_IF_ERROR(env_.ExplainLostContext(
      caller, env_.CheckContext(caller, req.context_id(), p->admitted_module)));
  if (!req.has_grad_output()) return absl::InvalidArgumentError("grad_output is required");
  core::WireBackwardRequest& in = p->in;
  GW_ASSIGN_OR_RETURN(in.grad_input_dtype,
                      wire::OutputDType(req.grad_input_dtype(), "grad_input_dtype"));
  const std::string owner = RegionOwner(caller);
  const int64_t limit = options_.limits.max_tensor_elements;
  {
    TransferTimer timer(p->transfer);
    GW_ASSIGN_OR_RETURN(in.grad_output,
                        request_tensors_.Gather(owner, req.grad_output(), "grad_output",
                                                p->gathered.get(), raw, 2));
  }
  GW_RETURN_IF_ERROR(CheckElements("grad_output", in.grad_output.numel(), limit));
  if (req.has_grad_layernorm_output()) {
    TransferTimer timer(p->transfer);
    GW_ASSIGN_OR_RETURN(
        in.grad_layernorm_output,
        request_tensors_.Gather(owner, req.grad_layernorm_output(), "grad_layernorm_output",
                                p->gathered_ln.get(), raw, 6));
    GW_RETURN_IF_ERROR(
        CheckElements("grad_layernorm_output", in.grad_layernorm_output.numel(), limit));
  }
  in.grad_output_column_sums.assign(req.grad_output_column_sums().begin(),
                                    req.grad_output_column_sums().end());
  in.retain = req.retain();
  in.skip_grad_input = req.skip_grad_input();
  if (req.has_grad_input_shared_memory() && !in.skip_grad_input) {
    // Room for grad_input, checked before the backward accumulates anything.
    const std::string module_id =
        !p->admitted_module.empty() ? p->admitted_module
                                    : host_.contexts().ModuleOf(req.context_id(), TenantOf(caller));
    GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(module_id));
    const uint64_t rows =
        uint64_t(in.grad_output.numel() / std::max<int64_t>(1, spec.out_features));
    GW_RETURN_IF_ERROR(request_tensors_.CheckRoom(
        owner, req.grad_input_shared_memory(), "grad_input_shared_memory",
        rows * uint64_t(spec.in_features) * uint64_t(wire::ElementSize(in.grad_input_dtype))));
  }
  if (call.Abandoned()) {  // the context stays for a retry
    return absl::CancelledError("Backward was cancelled or passed its deadline; nothing was run");
  }
  return absl::OkStatus();
}

absl::Status GradwireService::FinishBackward(
    const Caller& caller, const v1::BackwardRequest& req, v1::BackwardResponse* resp,
    PreparedBackward& p, absl::StatusOr<std::optional<wire::EncodedTensor>> computed) {
  GW_RETURN_IF_ERROR(env_.ExplainLostContext(caller, computed.status()));
  std::optional<wire::EncodedTensor>& grad_input = *computed;
  if (grad_input) {
    TransferTimer timer(p.transfer);
    absl::Status delivered = request_tensors_.Deliver(
        RegionOwner(caller), req.has_grad_input_shared_memory(), req.grad_input_shared_memory(),
        "grad_input_shared_memory", std::move(*grad_input), resp->mutable_grad_input());
    if (!delivered.ok()) {
      return absl::Status(delivered.code(),
                          absl::StrCat(delivered.message(),
                                       "; the backward ran (its gradients were accumulated) but "
                                       "grad_input could not be delivered"));
    }
  }
  resp->set_server_seconds(SecondsSince(p.start) - p.transfer);
  return absl::OkStatus();
}

absl::Status GradwireService::DoRelease(const Caller& caller,
                                        const v1::ReleaseContextRequest& req) {
  GW_RETURN_IF_ERROR(env_.ExplainLostContext(caller, env_.CheckContext(caller, req.context_id())));
  return env_.ExplainLostContext(caller, host_.ReleaseContext(req.context_id()));
}

GradwireService::Unary* GradwireService::Forward(Ctx* ctx, const grpc::ByteBuffer* req,
                                                 grpc::ByteBuffer* resp) {
  return StepCall<ForwardStep>(ctx, req, resp);
}

GradwireService::Unary* GradwireService::Backward(Ctx* ctx, const grpc::ByteBuffer* req,
                                                  grpc::ByteBuffer* resp) {
  return StepCall<BackwardStep>(ctx, req, resp);
}

// What a forward and a backward differ in, for the one pipeline: the messages, how a request's
// rows and its batch are found, its halves around the compute, and the batch's compute.
struct GradwireService::ForwardStep {
  using Request = v1::ForwardRequest;
  using Response = v1::ForwardResponse;
  using Prepared = PreparedForward;
  using Output = absl::StatusOr<core::WireForwardOutput>;
  static constexpr const char* kMethod = "Forward";
  static std::initializer_list<int> RequestTensors() { return wire::kForwardRequestTensors; }
  static std::initializer_list<int> ResponseTensors() { return wire::kForwardResponseTensors; }
  static const v1::Tensor* Rows(const Request& r) { return r.has_input() ? &r.input() : nullptr; }
  // Forwards of one module, training or not, with one input dtype (how the input reaches the
  // kind) share a batch; empty: the request runs alone.
  static std::string Key(const Request& r, const std::string& /*module*/) {
    if (!r.has_input() || r.input().shape().empty() ||
        r.input().shape(r.input().shape_size() - 1) <= 0) {
      return {};
    }
    return absl::StrCat(r.module_id(), r.training() ? "/train/" : "/", int(r.input().dtype()));
  }
  static constexpr auto kPrepare = &GradwireService::PrepareForward;
  // What the admission found is not needed: a forward names its module.
  static void Admitted(Prepared&, const std::string& /*module*/) {}
  template <typename J>
  static std::vector<Output> Compute(GradwireService& s,
                                     const std::vector<std::shared_ptr<J>>& ready,
                                     core::BatchRan* together) {
    std::vector<const core::WireForwardRequest*> reqs;
    for (const auto& r : ready) reqs.push_back(&r->prepared.f);
    std::vector<Output> outs = s.host_.ForwardBatch(ready[0]->in.request->module_id(), reqs);
    // What ran as one backend call (a batch that fell back to its requests one by one, or a
    // request alone, reports none).
    for (size_t i = 0; i < ready.size(); ++i) {
      if (!outs[i].ok() || outs[i]->batch_requests == 0) continue;
      together->requests = outs[i]->batch_requests;
      const wire::TensorView& in = ready[i]->prepared.f.input;
      together->rows += in.numel() / std::max<int64_t>(1, in.shape.back());
    }
    return outs;
  }
  // The input was read: its gather buffer goes now, on the executor.
  static void DropGathered(Prepared& p) { p.gathered.reset(); }
  static absl::Status Finish(GradwireService& s, const Caller& caller, const Request& req,
                             Response* resp, const CallBase& call, Prepared& p, Output out) {
    return s.FinishForward(caller, req, resp, call, p, std::move(out));
  }
};

struct GradwireService::BackwardStep {
  using Request = v1::BackwardRequest;
  using Response = v1::BackwardResponse;
  using Prepared = PreparedBackward;
  using Output = absl::StatusOr<std::optional<wire::EncodedTensor>>;
  static constexpr const char* kMethod = "Backward";
  static std::initializer_list<int> RequestTensors() { return wire::kBackwardRequestTensors; }
  static std::initializer_list<int> ResponseTensors() { return wire::kBackwardResponseTensors; }
  static const v1::Tensor* Rows(const Request& r) {
    return r.has_grad_output() ? &r.grad_output() : nullptr;
  }
  // Backwards of one module's contexts share a batch, keyed also by what the kind computes
  // (grad_input or not, a LayerNorm output's gradient or not) and by how grad_output comes (FP8
  // or not, with column sums or not): a batch is one kind call. The
  // module is the one the call's admission found: a context of another tenant, or none, runs
  // alone and fails.
  static std::string Key(const Request& r, const std::string& module) {
    if (!r.has_grad_output() || r.grad_output().shape().empty()) return {};
    if (module.empty()) return {};
    const v1::DType dtype = r.grad_output().dtype();
    return absl::StrCat(module, "/backward/", int(r.skip_grad_input()),
                        int(r.has_grad_layernorm_output()),
                        int(dtype == v1::FP8_E4M3 || dtype == v1::FP8_E5M2),
                        int(r.grad_output_column_sums_size() > 0));
  }
  static constexpr auto kPrepare = &GradwireService::PrepareBackward;
  // The context's module as the admission found it: its preparation looks nothing up again.
  static void Admitted(Prepared& p, const std::string& module) { p.admitted_module = module; }
  template <typename J>
  static std::vector<Output> Compute(GradwireService& s,
                                     const std::vector<std::shared_ptr<J>>& ready,
                                     core::BatchRan* together) {
    std::vector<std::string> contexts;
    std::vector<const core::WireBackwardRequest*> reqs;
    for (const auto& r : ready) {
      contexts.push_back(r->in.request->context_id());
      reqs.push_back(&r->prepared.in);
    }
    return s.host_.BackwardBatch(contexts, reqs, together);
  }
  // The gradients were read: their gather buffers go now, on the executor.
  static void DropGathered(Prepared& p) {
    p.gathered.reset();
    p.gathered_ln.reset();
  }
  static absl::Status Finish(GradwireService& s, const Caller& caller, const Request& req,
                             Response* resp, const CallBase&, Prepared& p, Output out) {
    return s.FinishBackward(caller, req, resp, p, std::move(out));
  }
};

template <typename Step>
struct GradwireService::Job {
  StepJob<typename Step::Request, typename Step::Response> in;
  const Caller* caller = nullptr;        // the call's (set before it is queued)
  const CallBase* call = nullptr;        // (set before it runs)
  std::shared_ptr<const CallBase> hold;  // the call, alive until `in.done` has run
  typename Step::Prepared prepared;
  std::function<void()> task;  // the call's queued work, until its batch runs it
  bool batched = false;        // queued in a batch (set before the work runs)
  bool ready = false;          // prepared, waiting for its batch's compute
};

template <typename Step>
void GradwireService::End(const std::shared_ptr<Job<Step>>& job, absl::Status status) {
  std::function<void(absl::Status)> done = std::exchange(job->in.done, nullptr);
  if (done) done(std::move(status));
  job->hold.reset();
}

template <typename Step>
void GradwireService::Submit(const std::shared_ptr<Job<Step>>& job, std::function<void()> task,
                             Order* order, const std::string& module) {
  const Caller& caller = *job->caller;
  Step::Admitted(job->prepared, module);
  const std::string key = batcher_ ? Step::Key(*job->in.request, module) : std::string();
  if (key.empty()) {
    if (order != nullptr) order->Alone();
    env_.executor().Submit(caller.client, std::move(task));
    return;
  }
  // Rows bound the batch: the leading dimensions of the tensor the rows come in.
  int64_t rows = 1;
  if (const v1::Tensor* t = Step::Rows(*job->in.request)) {
    for (int i = 0; i + 1 < t->shape_size(); ++i) {
      rows = std::min<int64_t>(int64_t(1) << 40, rows * std::max<int64_t>(0, t->shape(i)));
    }
  }
  job->task = std::move(task);
  job->batched = true;
  batcher_->Add(
      key, {caller.client, rows, job},
      [this](std::vector<scheduling::BatchFormer::Member>& members,
             scheduling::BatchFormer::Run& run) { RunBatch<Step>(members, run); },
      order);
}

template <typename Step>
void GradwireService::RunJob(const std::shared_ptr<Job<Step>>& job, absl::Status started) {
  if (!started.ok()) {
    End(job, std::move(started));
    return;
  }
  absl::Status prepared;
  try {
    prepared = (this->*Step::kPrepare)(*job->caller, *job->in.request, *job->call, job->in.raw,
                                       &job->prepared);
  } catch (const std::exception& e) {
    prepared = absl::InternalError(absl::StrCat(Step::kMethod, " failed: ", e.what()));
    spdlog::error("{}", std::string(prepared.message()));
  }
  if (!prepared.ok()) {
    End(job, std::move(prepared));
    return;
  }
  if (job->batched) {  // its batch computes it, with the others
    job->ready = true;
    return;
  }
  Compute<Step>({job}, /*alone=*/true);
}

template <typename Step>
void GradwireService::RunBatch(std::vector<scheduling::BatchFormer::Member>& members,
                               scheduling::BatchFormer::Run& run) {
  // Each job's work up to the compute (its own checks, its own cancellation), then one compute
  // for those still there, then each one's delivery and end.
  std::vector<std::shared_ptr<Job<Step>>> ready = PrepareMembers<Job<Step>>(members, run);
  if (!ready.empty()) Compute<Step>(ready, /*alone=*/false);
}

template <typename Step>
void GradwireService::Compute(const std::vector<std::shared_ptr<Job<Step>>>& ready, bool alone) {
  std::vector<typename Step::Output> outs;
  core::BatchRan together;
  try {
    outs = Step::Compute(*this, ready, &together);
  } catch (const std::exception& e) {
    const absl::Status failed =
        absl::InternalError(absl::StrCat(Step::kMethod, " failed: ", e.what()));
    if (alone) {
      spdlog::error("{}", std::string(failed.message()));
    } else {
      spdlog::error("a batch of {} {} calls failed: {}", ready.size(), Step::kMethod, e.what());
    }
    for (const auto& job : ready) End(job, failed);
    return;
  }
  for (const auto& job : ready) Step::DropGathered(job->prepared);
  if (together.requests > 0 && options_.on_batch) {
    options_.on_batch(Step::kMethod, together.requests, together.rows);
  }
  if (alone) {  // here, on the device executor, as the call's own work
    FinishJob<Step>(ready[0], std::move(outs[0]));
    return;
  }
  // Delivery and the end of each job of a batch are host work: on the control thread, so the
  // device executor goes on to the next task (another tenant's) at once.
  for (size_t i = 0; i < ready.size(); ++i) {
    env_.control().Submit(ready[i]->caller->client,
                          [this, job = ready[i], out = std::move(outs[i])]() mutable {
                            FinishJob<Step>(job, std::move(out));
                          });
  }
}

template <typename Step>
void GradwireService::FinishJob(const std::shared_ptr<Job<Step>>& job, typename Step::Output out) {
  RequestScope scope(job->call->request());
  absl::Status status;
  try {
    status = Step::Finish(*this, *job->caller, *job->in.request, job->in.response, *job->call,
                          job->prepared, std::move(out));
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat(Step::kMethod, " failed: ", e.what()));
    spdlog::error("{}", std::string(status.message()));
  }
  End(job, std::move(status));
}

template <typename Step>
StepEntry GradwireService::Enter(const CallBase& call,
                                 StepJob<typename Step::Request, typename Step::Response> in,
                                 Order* order) {
  auto job = std::make_shared<Job<Step>>();
  job->in = std::move(in);
  job->caller = &call.caller();
  job->call = &call;
  job->hold = call.Hold();
  return {[this, job](absl::Status started) { RunJob<Step>(job, std::move(started)); },
          [this, job, order](std::function<void()> task, const std::string& module) {
            Submit<Step>(job, std::move(task), order, module);
          }};
}

StepEntry GradwireService::Forward(const CallBase& call, ForwardJob in, Order* order) {
  return Enter<ForwardStep>(call, std::move(in), order);
}

StepEntry GradwireService::Backward(const CallBase& call, BackwardJob in, Order* order) {
  return Enter<BackwardStep>(call, std::move(in), order);
}

template <typename Step>
GradwireService::Unary* GradwireService::StepCall(Ctx* ctx, const grpc::ByteBuffer* req,
                                                  grpc::ByteBuffer* resp) {
  // The request and response live until the job's end.
  struct Message {
    wire::ReceivedMessage received;
    typename Step::Request req;
    typename Step::Response resp;
    absl::Status parsed;
  };
  auto m = std::make_shared<Message>();
  m->parsed = m->received.Parse(*req, &m->req, Step::RequestTensors());
  auto job = std::make_shared<Job<Step>>();
  job->in.request = &m->req;
  job->in.response = &m->resp;
  job->in.raw = &m->received;
  const RequestIds ids = m->parsed.ok() ? IdsOf(m->req) : RequestIds{};
  return StartDeferrableUnary(
      env_, ctx, Step::kMethod,
      [this, m, job, resp](const Caller&, const CallBase& call,
                           std::unique_ptr<PendingUnary>* pending) -> absl::Status {
        GW_RETURN_IF_ERROR(m->parsed);
        job->call = &call;  // the pending end holds the call
        job->in.done = [m, resp, end = std::shared_ptr<PendingUnary>(std::move(*pending))](
                           absl::Status status) {
          std::string created;
          if (status.ok()) {
            wire::SerializeMoving(&m->resp, Step::ResponseTensors(), resp);
            // A training forward's context goes when its answer does not reach the client.
            created = CreatedBy(m->resp);
          }
          end->Finish(std::move(status), std::move(created));
        };
        RunJob<Step>(job, absl::OkStatus());
        return absl::OkStatus();
      },
      [this, m, job](const Caller& caller, std::function<void()> task, const std::string& module) {
        job->caller = &caller;
        if (!m->parsed.ok()) {  // answered by its work
          env_.executor().Submit(caller.client, std::move(task));
          return;
        }
        Submit<Step>(job, std::move(task), nullptr, module);
      },
      ids.module_id, RequestSize(int64_t(req->Length())), [m] { return CreatedBy(m->resp); },
      ids.context_id);
}

GradwireService::Unary* GradwireService::ReleaseContext(Ctx* ctx,
                                                        const v1::ReleaseContextRequest* req,
                                                        v1::ReleaseContextResponse*) {
  return StartUnary(
      env_, ctx, "ReleaseContext",
      [this, req](const Caller& caller, const CallBase&) { return DoRelease(caller, *req); }, {},
      req->context_id());
}

}  // namespace gradwire::rpc
