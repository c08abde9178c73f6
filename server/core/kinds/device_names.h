// The device layer's names the core speaks. The device layer (server/device) lives in namespace
// gradwire::device; the kinds and the host are written against its backend and FP8 types by these
// names, listed here once rather than qualified on every line. The recipe's names (recipe.h) are
// declared with the spec, in module_spec.h, which stays torch-free.
#pragma once

#include "server/device/backend.h"
#include "server/device/device_scaling.h"
#include "server/device/fp8_tensor.h"
#include "server/device/quantizer.h"
#include "server/device/reference_backend.h"

namespace gradwire::core {

using device::Backend;
using device::BackendPtr;
using device::CastScalars;
using device::CastUsage;
using device::DeviceScaling;
using device::Fp8Tensor;
using device::LayerNormOut;
using device::LayerNormParams;
using device::MakeCpuBackend;
using device::MakeReferenceBackend;
using device::QuantizerConfig;
using device::ReplayOf;
using device::ScaleSteps;
using device::SetBlockScaling;
using device::ValuePanels;

}  // namespace gradwire::core
