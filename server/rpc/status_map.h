// The one place a core status becomes a gRPC status. absl and gRPC share the canonical codes.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace gradwire::rpc {

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace gradwire::rpc
