// Builds without the CUDA backend (GRADWIRE_CUDA off): MakeCudaBackend says why.
#include "server/device/backend.h"

namespace gradwire::device {

bool CudaBackendBuilt() { return false; }

absl::StatusOr<BackendPtr> MakeCudaBackend(int device) {
  (void)device;
  return absl::UnavailableError(
      "this build has no CUDA backend (configured with GRADWIRE_CUDA=OFF or without the CUDA "
      "toolkit)");
}

}  // namespace gradwire::device
