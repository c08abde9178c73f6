// Every CUDA runtime call goes through GRADWIRE_CUDA_CHECK: a failure throws CudaError naming the
// call, the file and the line. Callers above kernels/ convert it to a status at their boundary.
#pragma once

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

}  // namespace gradwire::kernels::cuda

#define GRADWIRE_CUDA_CHECK(call)                                                              \
  do {                                                                                         \
    const cudaError_t gradwire_status_ = (call);                                               \
    if (gradwire_status_ != cudaSuccess)                                                       \
      throw ::gradwire::kernels::cuda::CudaError(gradwire_status_, #call, __FILE__, __LINE__); \
  } while (0)
