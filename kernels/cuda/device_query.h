// What CUDA devices this process can use. Free of CUDA headers so the server can include it.
#pragma once

#include <string>

namespace gradwire::kernels::cuda {

// Number of usable CUDA devices; 0 (with *why set) when there is no driver or no device.
int DeviceCount(std::string* why);

// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)" for a valid device index.
std::string DeviceDescription(int device);

}  // namespace gradwire::kernels::cuda
