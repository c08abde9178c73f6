// Every CUDA runtime call goes through GRADWIRE_CUDA_CHECK and every cuBLASLt call through
// GRADWIRE_CUBLAS_CHECK: a failure throws CudaError / CublasError naming the call, the file, the
// line and the status. Callers above kernels/ convert it to a status at their boundary.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace gradwire::kernels::cuda {

class CudaError : public std::runtime_error {
 public:
  CudaError(cudaError_t code, const char* call, const char* file, int line)
      : std::runtime_error(std::string(call) + " failed at " + file + ":" + std::to_string(line) +
                           ": " + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) + ")"),
        code_(code) {}
  cudaError_t code() const { return code_; }

 private:
  cudaError_t code_;
};

// A failed cuBLASLt call: the call, file, line and the library's status name.
class CublasError : public std::runtime_error {
 public:
  CublasError(cublasStatus_t status, const char* call, const char* file, int line)
      : std::runtime_error(std::string(call) + " failed at " + file + ":" + std::to_string(line) +
                           ": " + cublasLtGetStatusName(status) + " (" +
                           cublasLtGetStatusString(status) + ")"),
        status_(status) {}
  cublasStatus_t status() const { return status_; }

 private:
  cublasStatus_t status_;
};

}  // namespace gradwire::kernels::cuda

#define GRADWIRE_CUDA_CHECK(call)                                                              \
  do {                                                                                         \
    const cudaError_t gradwire_status_ = (call);                                               \
    if (gradwire_status_ != cudaSuccess)                                                       \
      throw ::gradwire::kernels::cuda::CudaError(gradwire_status_, #call, __FILE__, __LINE__); \
  } while (0)

#define GRADWIRE_CUBLAS_CHECK(call)                                                          \
  do {                                                                                       \
    const cublasStatus_t gradwire_cublas_status_ = (call);                                   \
    if (gradwire_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                    \
      throw ::gradwire::kernels::cuda::CublasError(gradwire_cublas_status_, #call, __FILE__, \
                                                   __LINE__);                                \
  } while (0)
