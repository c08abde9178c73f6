// What a request may ask for, checked before anything runs or is allocated for it: the element
// limits (--max-tensor-elements) on what it sends and on what the module's kind would build,
// live training contexts per client (--max-contexts-per-client), and for a chunked request what
// its header allows checking before its tensors are received. Each refusal names the field or
// the flag.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "gradwire/v1/service.pb.h"
#include "server/core/module_host.h"
#include "server/rpc/call.h"

namespace gradwire::rpc {

// What a request names, for admission and the report.
struct RequestIds {
  std::string module_id, context_id;
};
inline RequestIds IdsOf(const v1::ForwardRequest& r) { return {r.module_id(), {}}; }
inline RequestIds IdsOf(const v1::BackwardRequest& r) { return {{}, r.context_id()}; }
inline RequestIds IdsOf(const v1::SetWeightsRequest& r) { return {r.module_id(), {}}; }
// The context a response hands the client, which nobody else knows: released when the response
// never arrives.
inline std::string CreatedBy(const v1::ForwardResponse& r) { return r.context_id(); }
inline std::string CreatedBy(const v1::BackwardResponse&) { return {}; }

class RequestChecks {
 public:
  // `host` and `env` must outlive the checks.
  RequestChecks(const core::ModuleHost& host, const CallEnv& env, const ServiceLimits& limits)
      : host_(host), env_(env), limits_(limits) {}

  // The element limits on the input a forward declares and on what it would build (from the rows
  // the input declares), and for a training forward the caller's live contexts.
  absl::Status CheckForward(const Caller& caller, const v1::ForwardRequest& req) const;

  // A chunked request's header: the ids and their ownership, no shared memory (the chunked calls
  // carry bytes in chunks), the shapes against the module and the element limits.
  absl::Status CheckHeader(const Caller& caller, const v1::ForwardRequest& req) const;
  absl::Status CheckHeader(const Caller& caller, const v1::BackwardRequest& req) const;
  absl::Status CheckHeader(const Caller& caller, const v1::SetWeightsRequest& req) const;

 private:
  const core::ModuleHost& host_;
  const CallEnv& env_;
  const ServiceLimits limits_;
};

}  // namespace gradwire::rpc
