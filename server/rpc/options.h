// How the service is configured (ServiceOptions and its parts) and the record of one finished
// call. Apart from service.h, so that the call objects and the collaborators read the options
// without seeing the service.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "server/core/module_spec.h"
#include "server/rpc/request_id.h"
#include "server/rpc/scheduling/batcher.h"
#include "server/rpc/shared_memory.h"

namespace gradwire::core {
class Checkpointer;
}

namespace gradwire::rpc {

class Authenticator;

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
  // --module-ttl: a module whose owner made no call that succeeded and sent no keep-alive for
  // this long is released (0: never; with a checkpointer every module is durable and none is).
  double module_ttl_s = 3600;
  std::string version;      // reported by GetServerInfo
  std::string device;       // "cpu" or "cuda:N"
  std::string device_name;  // human-readable description of the device
  // Persists modules on create, weight upload, delete and every N optimizer steps, and takes over
  // a module with a checkpoint on the first call about it; null: none.
  core::Checkpointer* checkpointer = nullptr;
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
  // The recipe of a module created without one (SCALING_RECIPE_UNSPECIFIED): the server's
  // --default-recipe (spec_convert.h says what a margin changes). Restored modules keep theirs.
  core::ScalingMode default_recipe = core::ScalingMode::kCurrent;
  // Dynamic batching of unary forwards and backwards (docs/batching.md); off unless max_rows > 1.
  scheduling::BatchOptions batching;
  // Called for every batch that ran as one backend call, with its method ("Forward",
  // "Backward"), requests and rows (metrics); may be empty.
  std::function<void(const char* method, int64_t requests, int64_t rows)> on_batch;
};

}  // namespace gradwire::rpc
