// The in-process baseline: the same module and flow run on a ModuleHost in this process, without
// gRPC, so network and service overhead is a ratio measured in one run. (Links libtorch.)
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gradwire/v1/module.pb.h"
#include "runner.h"

namespace gradwire::load {

class InProcess {
 public:
  virtual ~InProcess() = default;
  // flow: "forward" or "step"; input rows x spec.in_features, fresh random values; device:
  // "cpu" or "cuda", the backend the in-process module computes on.
  static absl::StatusOr<std::unique_ptr<InProcess>> Make(const v1::ModuleSpec& spec,
                                                         const std::string& flow, int64_t rows,
                                                         int workers, uint64_t seed,
                                                         const std::string& device = "cpu");
  virtual OpOutcome Run(int worker) = 0;
};

// Gives this process the heap policy gradwire-server starts with (core/heap_trim.h: freed large
// blocks stay in the heap), so the in-process baseline and the client side of the remote runs
// allocate as the server does. False where the C library cannot.
bool UseServerHeapPolicy();

// The CPU backend's threads for the in-process baseline, as gradwire-server's --cpu-threads and
// --cpu-gemm-threads set them (0: one per core; gemm_on_blas: BLAS's own threads).
void SetBaselineCpuThreads(int threads, bool gemm_on_blas);

// The CUDA in-process baseline's pinned staging, as gradwire-server's --cuda-staging-mib.
void SetBaselineCudaStaging(int mib);

}  // namespace gradwire::load
