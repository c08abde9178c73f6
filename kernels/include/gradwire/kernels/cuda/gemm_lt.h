// FP8 GEMM of the CUDA backend on cuBLASLt.
//
//   D[m, n] = scale_inv_a * scale_inv_b * A[m, k] . B[n, k]^T  (+ bias[n])  (+ D if accumulate)
//
// Row-major operands, both contiguous along k: the only layout FP8 tensor cores take (cuBLASLt's
// "TN"). The three products of a Linear layer map onto it as in gradwire/kernels/ref/gemm.h:
//   forward  Y  = X . W^T      a = X  rowwise [M, K],  b = W rowwise   [N, K]
//   dgrad    dX = dY . W       a = dY rowwise [M, N],  b = W columnwise [K, N]
//   wgrad    dW = dY^T . X     a = dY columnwise [N, M], b = X columnwise [K, M] (accumulate)
// Products of FP8 values are accumulated in fp32 (CUBLAS_COMPUTE_32F). Accumulation kFast sets
// CUBLASLT_MATMUL_DESC_FAST_ACCUM (no periodic promotion: the forward's choice); kSplit leaves it
// off (the gradients' choice). E5M2 x E5M2 is not a tensor-core type pair and is rejected.
//
// Shapes: m, n and k must each be a multiple of 16 (FP8 tensor cores need 16-byte aligned leading
// dimensions); anything else throws std::invalid_argument naming the dimension — pad the
// operands. All data pointers must be 16-byte aligned.
//
// Plans: the first call of a (m, n, k, types, epilogue, accumulation, device) builds the matmul
// descriptor, the layouts, the preference and the heuristic's algorithm and keeps them for the
// process; later calls set only the pointers. A cuBLASLt handle per device and a 32 MiB workspace
// per (device, stream) are created on first use and kept. Calls are thread-safe.
//
// Errors: std::invalid_argument for bad arguments (nothing launched), CublasError / CudaError
// (kernels/cuda/check.h) for library failures, std::runtime_error when cuBLASLt has no algorithm.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "gradwire/kernels/cuda/stream.h"
#include "gradwire/kernels/fp8.h"

namespace gradwire::kernels::cuda {

enum class GemmOut : uint8_t { kFloat32 = 0, kBFloat16 = 1 };
enum class GemmAccumulation : uint8_t { kFast = 0, kSplit = 1 };
// Measured on an H100 with cuBLASLt 13.0 (tests/kernels/cuda_gemm_test.cc, docs/cuda.md): with
// FP8 operands the bias epilogue takes a bf16 bias for fp32 and bf16 outputs alike (an fp32 bias
// is refused with CUBLAS_STATUS_NOT_SUPPORTED), and the BGRADB epilogue (dbias from an operand)
// is refused for FP8 operands: dbias comes from the cast of dY (CastTransposeDbias) instead.
enum class GemmEpilogue : uint8_t {
  kNone = 0,
  kBias = 1,  // D += bias[n], broadcast over rows
};

struct LtGemmArgs {
  const uint8_t* a = nullptr;  // device [m, k] FP8 codes
  Fp8Format a_format = Fp8Format::kE4M3;
  const float* a_scale_inv = nullptr;  // device [1]
  const uint8_t* b = nullptr;          // device [n, k] FP8 codes
  Fp8Format b_format = Fp8Format::kE4M3;
  const float* b_scale_inv = nullptr;  // device [1]
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  void* d = nullptr;  // device [m, n], fp32 or bf16 as d_type
  GemmOut d_type = GemmOut::kFloat32;
  bool accumulate = false;  // D += product (D is read)
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  const uint16_t* bias = nullptr;  // device [n] bf16, read; kBias only
  GemmAccumulation accumulation = GemmAccumulation::kFast;
  cudaStream_t stream = nullptr;
};

// Why `args` cannot run ("" when it can): the checks Fp8GemmLt makes before touching the device.
std::string ValidateLtGemm(const LtGemmArgs& args);

// Runs the GEMM asynchronously on args.stream (throws as described above).
void Fp8GemmLt(const LtGemmArgs& args);

// What identifies a plan: everything that shapes the descriptors and the algorithm choice.
struct LtPlanKey {
  int64_t m = 0, n = 0, k = 0;
  Fp8Format a_format = Fp8Format::kE4M3;
  Fp8Format b_format = Fp8Format::kE4M3;
  GemmOut d_type = GemmOut::kFloat32;
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  GemmAccumulation accumulation = GemmAccumulation::kFast;
  bool accumulate = false;
  int device = 0;
  bool operator==(const LtPlanKey& other) const;
};
struct LtPlanKeyHash {
  size_t operator()(const LtPlanKey& key) const;
};
LtPlanKey PlanKeyOf(const LtGemmArgs& args, int device);

// Plans built so far (all devices): for tests and metrics.
size_t LtPlanCount();

}  // namespace gradwire::kernels::cuda
