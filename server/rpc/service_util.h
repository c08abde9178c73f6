// Small helpers the service's sources share (service.cc, steps.cc).
#pragma once

#include <string>

#include "server/rpc/call.h"

namespace gradwire::rpc {

// Whose shared-memory regions a caller sees: its tenant with tokens, else everyone's.
inline std::string RegionOwner(const Caller& caller) {
  return caller.isolated ? caller.tenant : "";
}

// The tenant a caller's lookups are narrowed to: its own with tokens, none without.
inline const std::string* TenantOf(const Caller& caller) {
  return caller.isolated ? &caller.tenant : nullptr;
}

}  // namespace gradwire::rpc
