#include <string>

#include "check.h"
#include "gradwire/kernels/cuda/layernorm.h"
#include "tile_cast.cuh"

namespace gradwire::kernels::cuda {
namespace {

constexpr int kRowThreads = 256;

// An element of x as float32: itself, or a bfloat16 (the upper half of a float32) widened by a
// shift, exactly. Every kernel below reads x through it, so a bf16 x gives, bit for bit, what its
// widening gives.
__device__ __forceinline__ float Load(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float Load(const uint16_t* x, int64_t i) {
  return __uint_as_float(uint32_t(x[i]) << 16);
}

// Sum over the block (kRowThreads threads); every thread gets the result.
__device__ float BlockSum(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kRowThreads / 32; ++w) total += scratch[w];
  return total;
}

// One block per row: the mean and rstd exactly as the reference forms them (two passes, biased
// variance, correctly rounded division and square root), the sums in tree order.
template <typename T>
__global__ void LayerNormStatsKernel(const T* x, int64_t cols, float eps, float* mu, float* rstd) {
  __shared__ float scratch[kRowThreads / 32];
  const T* xr = x + int64_t(blockIdx.x) * cols;
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += kRowThreads) sum += Load(xr, c);
  const float mean = __fdiv_rn(BlockSum(sum, scratch), float(cols));
  float sq = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += kRowThreads) {
    const float d = __fsub_rn(Load(xr, c), mean);
    sq = __fadd_rn(sq, __fmul_rn(d, d));
  }
  sq = BlockSum(sq, scratch);
  if (threadIdx.x == 0) {
    mu[blockIdx.x] = mean;
    rstd[blockIdx.x] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sq, float(cols)), eps)));
  }
}

template <typename T>
struct LayerNormLoader {
  const T* x;
  const float* gamma;
  const float* beta;
  const float* mu;
  const float* rstd;
  int64_t cols;
  float offset;
  __device__ float operator()(int64_t r, int64_t c) const {
    const float xhat = __fmul_rn(__fsub_rn(Load(x, r * cols + c), mu[r]), rstd[r]);
    return __fadd_rn(__fmul_rn(xhat, __fadd_rn(gamma[c], offset)), beta[c]);
  }
};

template <typename T>
__global__ void LayerNormDxKernel(const float* dy, const T* x, const float* mu, const float* rstd,
                                  const float* gamma, int64_t cols, float offset, float* dx) {
  __shared__ float scratch[kRowThreads / 32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  const float* dyr = dy + r * cols;
  const float m = mu[r], s = rstd[r];
  float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += kRowThreads) {
    const float xhat = __fmul_rn(__fsub_rn(Load(xr, c), m), s);
    const float dxhat = __fmul_rn(dyr[c], __fadd_rn(gamma[c], offset));
    sum_dxhat += dxhat;
    sum_dxhat_xhat += dxhat * xhat;
  }
  const float mean_dxhat = __fdiv_rn(BlockSum(sum_dxhat, scratch), float(cols));
  const float mean_dxhat_xhat = __fdiv_rn(BlockSum(sum_dxhat_xhat, scratch), float(cols));
  for (int64_t c = threadIdx.x; c < cols; c += kRowThreads) {
    const float xhat = __fmul_rn(__fsub_rn(Load(xr, c), m), s);
    const float dxhat = __fmul_rn(dyr[c], __fadd_rn(gamma[c], offset));
    dx[r * cols + c] =
        __fmul_rn(s, __fsub_rn(__fsub_rn(dxhat, mean_dxhat), __fmul_rn(xhat, mean_dxhat_xhat)));
  }
}

// dgamma[c] += sum_r dy * xhat, dbeta[c] += sum_r dy: a thread per column over a chunk of rows
// (coalesced across the warp), one atomicAdd per chunk.
constexpr int kColumnThreads = 256;
constexpr int64_t kRowsPerChunk = 512;

template <typename T>
__global__ void LayerNormParamGradKernel(const float* dy, const T* x, const float* mu,
                                         const float* rstd, int64_t rows, int64_t cols,
                                         float* dgamma, float* dbeta) {
  const int64_t c = int64_t(blockIdx.x) * kColumnThreads + threadIdx.x;
  if (c >= cols) return;
  const int64_t r_begin = int64_t(blockIdx.y) * kRowsPerChunk;
  const int64_t r_end = r_begin + kRowsPerChunk < rows ? r_begin + kRowsPerChunk : rows;
  float g = 0.0f, b = 0.0f;
  for (int64_t r = r_begin; r < r_end; ++r) {
    const float d = dy[r * cols + c];
    const float xhat = __fmul_rn(__fsub_rn(Load(x, r * cols + c), mu[r]), rstd[r]);
    g += d * xhat;
    b += d;
  }
  atomicAdd(dgamma + c, g);
  atomicAdd(dbeta + c, b);
}

void CheckRows(const char* what, int64_t rows, int64_t cols) {
  detail::CheckShape(what, rows, cols);
  if (rows > 0x7FFFFFFF) throw std::invalid_argument(std::string(what) + ": too many rows");
}

template <typename T>
void Forward(const char* what, const T* x, int64_t rows, int64_t cols, const float* gamma,
             const float* beta, float eps, bool zero_centered_gamma, float* y, const Fp8Output* out,
             float* mu, float* rstd, cudaStream_t stream) {
  CheckRows(what, rows, cols);
  if (cols == 0) throw std::invalid_argument(std::string(what) + ": cols must be > 0");
  if (mu == nullptr || rstd == nullptr) {
    throw std::invalid_argument(std::string(what) + ": mu and rstd must not be null");
  }
  if (rows > 0) {
    LayerNormStatsKernel<T><<<unsigned(rows), kRowThreads, 0, stream>>>(x, cols, eps, mu, rstd);
    GRADWIRE_CUDA_CHECK(cudaGetLastError());
  }
  const LayerNormLoader<T> load{x, gamma, beta, mu, rstd, cols, zero_centered_gamma ? 1.0f : 0.0f};
  detail::RunTileCast(what, load, rows, cols, y, out, nullptr, stream);
}

template <typename T>
void Backward(const char* what, const float* dy, const T* x, const float* mu, const float* rstd,
              const float* gamma, int64_t rows, int64_t cols, bool zero_centered_gamma, float* dx,
              float* dgamma, float* dbeta, cudaStream_t stream) {
  CheckRows(what, rows, cols);
  if (rows == 0 || cols == 0) return;
  const float offset = zero_centered_gamma ? 1.0f : 0.0f;
  LayerNormDxKernel<T>
      <<<unsigned(rows), kRowThreads, 0, stream>>>(dy, x, mu, rstd, gamma, cols, offset, dx);
  GRADWIRE_CUDA_CHECK(cudaGetLastError());
  const dim3 grid(unsigned((cols + kColumnThreads - 1) / kColumnThreads),
                  unsigned((rows + kRowsPerChunk - 1) / kRowsPerChunk));
  LayerNormParamGradKernel<T>
      <<<grid, kColumnThreads, 0, stream>>>(dy, x, mu, rstd, rows, cols, dgamma, dbeta);
  GRADWIRE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void LayerNormForward(const float* x, int64_t rows, int64_t cols, const float* gamma,
                      const float* beta, float eps, bool zero_centered_gamma, float* y,
                      const Fp8Output* out, float* mu, float* rstd, cudaStream_t stream) {
  Forward("LayerNormForward", x, rows, cols, gamma, beta, eps, zero_centered_gamma, y, out, mu,
          rstd, stream);
}
void LayerNormForwardBf16(const uint16_t* x, int64_t rows, int64_t cols, const float* gamma,
                          const float* beta, float eps, bool zero_centered_gamma, float* y,
                          const Fp8Output* out, float* mu, float* rstd, cudaStream_t stream) {
  Forward("LayerNormForwardBf16", x, rows, cols, gamma, beta, eps, zero_centered_gamma, y, out, mu,
          rstd, stream);
}

void LayerNormBackward(const float* dy, const float* x, const float* mu, const float* rstd,
                       const float* gamma, int64_t rows, int64_t cols, bool zero_centered_gamma,
                       float* dx, float* dgamma, float* dbeta, cudaStream_t stream) {
  Backward("LayerNormBackward", dy, x, mu, rstd, gamma, rows, cols, zero_centered_gamma, dx, dgamma,
           dbeta, stream);
}
void LayerNormBackwardBf16(const float* dy, const uint16_t* x, const float* mu, const float* rstd,
                           const float* gamma, int64_t rows, int64_t cols, bool zero_centered_gamma,
                           float* dx, float* dgamma, float* dbeta, cudaStream_t stream) {
  Backward("LayerNormBackwardBf16", dy, x, mu, rstd, gamma, rows, cols, zero_centered_gamma, dx,
           dgamma, dbeta, stream);
}

}  // namespace gradwire::kernels::cuda
