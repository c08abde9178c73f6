// The operations of the device seam, listed once. Every Backend runs every op (the modules are
// written against all of them); what differs is who implements it. An op with a default in
// Backend (has_default) is composed from other ops or run by host code unless a backend runs it
// its own way, which Backend::Supports says. The parity harness (tests/core/backend_parity_test.cc)
// takes its rows from this list, so a new op has a parity row, failing until it has a check.
#pragma once

#include <vector>

namespace gradwire::device {

enum class Op {
  // Transfers: between the host, the wire and the device.
  kToDevice,
  kToHost,
  kFromWire,
  kFromWireBf16,
  kFromCodes,
  kToWire,
  // Compute.
  kCast,
  kDequantize,
  kWiden,
  kNarrowBf16,
  kPrepareWeight,
  kLayerNormForward,
  kLayerNormBackward,
  kActivationForward,
  kActivationBackward,
  kLayerNormCast,
  kActivationCast,
  kDActivationCast,
  kFprop,
  kFpropInto,
  kFpropBf16,
  kFpropGroups,
  kDgrad,
  kDgradInto,
  kDgradGroups,
  kWgrad,
  kAccumulateBiasGrad,
  // Scaling and the finite checks.
  kRollScaling,
  kAbsMax,
  kAddAbsMax,
  kAbsMaxLater,
};

enum class OpGroup { kTransfer, kCompute, kScaling };

struct OpInfo {
  Op op;
  const char* name;  // the Backend method's name
  OpGroup group;
  // Backend has a default for it (docs/backends.md says what each composes); a backend that runs
  // it otherwise overrides it and says so in Supports.
  bool has_default;
};

// Every op, in the enum's order (AllOps()[int(op)].op == op).
const std::vector<OpInfo>& AllOps();
const OpInfo& Describe(Op op);
const char* OpName(Op op);
const char* OpGroupName(OpGroup group);

}  // namespace gradwire::device
