// absl::Status helpers shared by the core and rpc layers.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define GW_STATUS_CONCAT_INNER(a, b) a##b
#define GW_STATUS_CONCAT(a, b) GW_STATUS_CONCAT_INNER(a, b)

// Returns from the current function when `expr` (an absl::Status) is not OK.
#define GW_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status gw_status_ = (expr);      \
    if (!gw_status_.ok()) return gw_status_; \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr), or return its error.
#define GW_ASSIGN_OR_RETURN(lhs, expr) \
  GW_ASSIGN_OR_RETURN_IMPL(GW_STATUS_CONCAT(gw_statusor_, __LINE__), lhs, expr)
#define GW_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
