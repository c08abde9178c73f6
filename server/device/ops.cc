// The device seam's op table (ops.h).
#include "server/device/ops.h"

#include <stdexcept>

namespace gradwire::device {

const std::vector<OpInfo>& AllOps() {
  using G = OpGroup;
  static const std::vector<OpInfo> ops = {
      {Op::kToDevice, "ToDevice", G::kTransfer, false},
      {Op::kToHost, "ToHost", G::kTransfer, false},
      {Op::kFromWire, "FromWire", G::kTransfer, false},
      {Op::kFromWireBf16, "FromWireBf16", G::kTransfer, true},
      {Op::kFromCodes, "FromCodes", G::kTransfer, false},
      {Op::kToWire, "ToWire", G::kTransfer, false},
      {Op::kCast, "Cast", G::kCompute, false},
      {Op::kDequantize, "Dequantize", G::kCompute, false},
      {Op::kWiden, "Widen", G::kCompute, true},
      {Op::kNarrowBf16, "NarrowBf16", G::kCompute, true},
      {Op::kPrepareWeight, "PrepareWeight", G::kCompute, true},
      {Op::kLayerNormForward, "LayerNormForward", G::kCompute, false},
      {Op::kLayerNormBackward, "LayerNormBackward", G::kCompute, false},
      {Op::kActivationForward, "ActivationForward", G::kCompute, false},
      {Op::kActivationBackward, "ActivationBackward", G::kCompute, false},
      {Op::kLayerNormCast, "LayerNormCast", G::kCompute, true},
      {Op::kActivationCast, "ActivationCast", G::kCompute, true},
      {Op::kDActivationCast, "DActivationCast", G::kCompute, true},
      {Op::kFprop, "Fprop", G::kCompute, false},
      {Op::kFpropInto, "FpropInto", G::kCompute, true},
      {Op::kFpropBf16, "FpropBf16", G::kCompute, true},
      {Op::kFpropGroups, "FpropGroups", G::kCompute, true},
      {Op::kDgrad, "Dgrad", G::kCompute, false},
      {Op::kDgradInto, "DgradInto", G::kCompute, true},
      {Op::kDgradGroups, "DgradGroups", G::kCompute, true},
      {Op::kWgrad, "Wgrad", G::kCompute, false},
      {Op::kAccumulateBiasGrad, "AccumulateBiasGrad", G::kCompute, false},
      {Op::kRollScaling, "RollScaling", G::kScaling, true},
      {Op::kAbsMax, "AbsMax", G::kScaling, false},
      {Op::kAddAbsMax, "AddAbsMax", G::kScaling, false},
      {Op::kAbsMaxLater, "AbsMaxLater", G::kScaling, true},
  };
  return ops;
}

const OpInfo& Describe(Op op) {
  const auto& ops = AllOps();
  const size_t i = static_cast<size_t>(op);
  if (i >= ops.size() || ops[i].op != op)
    throw std::logic_error("ops.cc: the op table is out of order");
  return ops[i];
}

const char* OpName(Op op) { return Describe(op).name; }

const char* OpGroupName(OpGroup group) {
  switch (group) {
    case OpGroup::kTransfer:
      return "transfer";
    case OpGroup::kCompute:
      return "compute";
    case OpGroup::kScaling:
      return "scaling";
  }
  return "?";
}

}  // namespace gradwire::device
