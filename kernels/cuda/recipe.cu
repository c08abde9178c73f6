#include <stdexcept>
#include <string>

#include "check.h"
#include "fp8_math.h"
#include "gradwire/kernels/cuda/recipe.h"

namespace gradwire::kernels::cuda {
namespace {

constexpr int kRollThreads = 256;
constexpr int64_t kMaxHistory = 8192;

// One block per tensor: the column is staged in shared memory, written back shifted by one, and
// its max reduced in the same sweep (the max of the new history is NanMax(pending, old[0..len-2])).
__global__ void RollKernel(float* history, const float* pending, const uint8_t* recorded,
                           int64_t history_len, Fp8Format format, int margin, AmaxAlgo algo,
                           float* scale, float* scale_inv) {
  extern __shared__ float old[];
  __shared__ float warp_max[kRollThreads / 32];
  __shared__ int warp_nan[kRollThreads / 32];
  const int64_t i = blockIdx.x;
  float* h = history + i * history_len;
  const bool roll = recorded == nullptr || recorded[i] != 0;
  if (roll) {
    for (int64_t j = threadIdx.x; j < history_len; j += kRollThreads) old[j] = h[j];
    __syncthreads();
    const float p = pending[i];
    float m = 0.0f;
    bool nan = false;
    for (int64_t j = threadIdx.x; j < history_len; j += kRollThreads) {
      const float v = j == 0 ? p : old[j - 1];
      h[j] = v;
      nan |= IsNanHD(v);
      m = v > m ? v : m;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xFFFFFFFFu, m, offset);
      m = other > m ? other : m;
      nan |= __shfl_xor_sync(0xFFFFFFFFu, int(nan), offset) != 0;
    }
    if (threadIdx.x % 32 == 0) {
      warp_max[threadIdx.x / 32] = m;
      warp_nan[threadIdx.x / 32] = nan;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 0; w < kRollThreads / 32; ++w) {
        m = warp_max[w] > m ? warp_max[w] : m;
        nan |= warp_nan[w] != 0;
      }
      // The reference's max starts from the pending amax; amaxes are >= 0, so starting from 0
      // and folding NaN in afterwards gives the same value.
      float amax =
          algo == AmaxAlgo::kMax ? (nan ? __uint_as_float(0x7FC00000u) : NanMaxHD(m, p)) : p;
      if (amax > 0.0f && IsFiniteHD(amax)) scale[i] = ComputeScaleHD(amax, format, margin);
    }
  }
  if (threadIdx.x == 0 && scale_inv)
    scale_inv[i] = __fdiv_rn(1.0f, scale[i]);  // same thread wrote it
}

}  // namespace

void DelayedScalingRoll(float* history, const float* pending, const uint8_t* recorded, int64_t n,
                        int64_t history_len, Fp8Format format, int margin, AmaxAlgo algo,
                        float* scale, float* scale_inv, cudaStream_t stream) {
  if (n < 0 || n > 0x7FFFFFFF) {
    throw std::invalid_argument("DelayedScalingRoll: n=" + std::to_string(n) + " out of range");
  }
  if (history_len < 1 || history_len > kMaxHistory) {
    throw std::invalid_argument("DelayedScalingRoll: history_len=" + std::to_string(history_len) +
                                " must be in 1.." + std::to_string(kMaxHistory));
  }
  if (algo != AmaxAlgo::kMax && algo != AmaxAlgo::kMostRecent) {
    throw std::invalid_argument("DelayedScalingRoll: unknown amax algorithm");
  }
  if (n == 0) return;
  if (history == nullptr || pending == nullptr || scale == nullptr) {
    throw std::invalid_argument("DelayedScalingRoll: history, pending and scale must not be null");
  }
  RollKernel<<<unsigned(n), kRollThreads, size_t(history_len) * sizeof(float), stream>>>(
      history, pending, recorded, history_len, format, margin, algo, scale, scale_inv);
  GRADWIRE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gradwire::kernels::cuda
