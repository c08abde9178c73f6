// Delayed scaling on the device: the end-of-step roll of ScalingState
// (server/device/scaling_state.cc) for many tensors in one kernel, bit-exact with it.
#pragma once

#include <cstdint>

#include "gradwire/kernels/cuda/stream.h"
#include "gradwire/kernels/fp8.h"

namespace gradwire::kernels::cuda {

enum class AmaxAlgo : uint8_t { kMax = 0, kMostRecent = 1 };

// For every tensor i in [0, n) whose recorded[i] != 0 (all when recorded is null):
//   history[i, :] shifts by one (the oldest drops), history[i, 0] = pending[i];
//   amax = max over history[i, :] (kMax; a NaN wins) or pending[i] (kMostRecent);
//   if amax > 0 and finite: scale[i] = ComputeScale(amax, format, margin).
// scale_inv[i] = 1 / scale[i] for every i when scale_inv is not null.
// history is [n, history_len], most recent first, zero-filled at the start (zeros never change a
// max of amaxes, so a partly filled history behaves as ScalingState's shorter deque). pending is
// left as it is (the caller resets it for the next step). history_len is 1 .. 8192.
void DelayedScalingRoll(float* history, const float* pending, const uint8_t* recorded, int64_t n,
                        int64_t history_len, Fp8Format format, int margin, AmaxAlgo algo,
                        float* scale, float* scale_inv, cudaStream_t stream);

}  // namespace gradwire::kernels::cuda
