#include <cstdio>

#include "check.h"
#include "device_query.h"

namespace gradwire::kernels::cuda {

int DeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (why) *why = std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  if (count == 0 && why) *why = "no CUDA device visible";
  return count;
}

std::string DeviceDescription(int device) {
  cudaDeviceProp prop{};
  GRADWIRE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  char text[320];
  std::snprintf(text, sizeof text, "%s (sm_%d%d, %.1f GiB)", prop.name, prop.major, prop.minor,
                double(prop.totalGlobalMem) / double(1ull << 30));
  return text;
}

}  // namespace gradwire::kernels::cuda
