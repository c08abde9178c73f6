// What one client holds against its quotas: reported by the service, rendered by the metrics.
#pragma once

#include <cstdint>
#include <string>

namespace gradwire::rpc {

struct ClientUsage {
  std::string client;           // "tenant NAME" with tokens, else "peer HOST"
  int64_t parameter_bytes = 0;  // fp32 parameters of its modules
  int64_t context_bytes = 0;    // saved tensors of its live contexts (device and host)
  int64_t stream_bytes = 0;     // chunked request bytes being received
  int64_t queued = 0;           // calls waiting for the executor
};

}  // namespace gradwire::rpc
