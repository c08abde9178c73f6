#include "inprocess.h"

#include <ATen/ATen.h>

#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gradwire/kernels/random.h"
#include "server/core/heap_trim.h"
#include "server/core/kinds/module_kind.h"
#include "server/core/module_host.h"
#include "server/device/backend.h"

namespace gradwire::load {
namespace {

using Clock = std::chrono::steady_clock;

at::Tensor Random(int64_t rows, int64_t cols, uint64_t seed, uint64_t stream) {
  at::Tensor t = at::empty({rows, cols}, at::kFloat);
  kernels::FillNormal(t.data_ptr<float>(), t.numel(), seed, stream);
  return t;
}

// An F32 tensor as the service hands it to the core: a view of its bytes.
wire::TensorView F32View(const at::Tensor& t) {
  return {wire::DType::kF32, t.data_ptr(), {t.sizes().begin(), t.sizes().end()}, 1.0f};
}

class HostBaseline final : public InProcess {
 public:
  absl::Status Init(const v1::ModuleSpec& p, const std::string& flow, int64_t rows, int workers,
                    uint64_t seed, const std::string& device) {
    device::BackendPtr backend = device::MakeCpuBackend();
    if (device == "cuda") {
      auto cuda = device::MakeCudaBackend(0);
      if (!cuda.ok()) return cuda.status();
      backend = *cuda;
    } else if (device != "cpu") {
      return absl::InvalidArgumentError(
          absl::StrCat("--baseline-device ", device, ": not a device (cpu or cuda)"));
    }
    host_ = std::make_unique<core::ModuleHost>(core::ContextLimits{}, nullptr, backend);
    core::ModuleSpec spec;
    // The kind by its contract name, as the service maps it; a Linear when unset.
    const core::ModuleKindOps* kind = core::FindKindBySpecName(v1::ModuleKind_Name(p.kind()));
    spec.kind = kind != nullptr ? kind->kind() : core::ModuleKind::kLinear;
    spec.in_features = p.in_features();
    spec.out_features = p.out_features();
    spec.ffn_features = p.ffn_features();
    spec.bias = p.bias();
    switch (p.recipe().scaling()) {
      case v1::DELAYED:
        spec.recipe.mode = device::ScalingMode::kDelayed;
        break;
      case v1::BLOCK:
        spec.recipe.mode = device::ScalingMode::kBlock;
        break;
      case v1::MXFP8:
        spec.recipe.mode = device::ScalingMode::kMxfp8;
        break;
      default:
        spec.recipe.mode = device::ScalingMode::kCurrent;
    }
    spec.seed = p.seed();
    auto info = host_->Create(spec);
    if (!info.ok()) return info.status();
    id_ = info->module_id;
    step_ = flow == "step";
    for (int w = 0; w < workers; ++w) {
      inputs_.push_back(Random(rows, spec.in_features, seed, 2 * uint64_t(w)));
      grads_.push_back(Random(rows, spec.out_features, seed, 2 * uint64_t(w) + 1));
    }
    return absl::OkStatus();
  }

  // The core's calls as the service makes them (wire views in, F32 encoded out), without the
  // transport.
  OpOutcome Run(int worker) override {
    OpOutcome o;
    const auto t0 = Clock::now();
    core::WireForwardRequest f;
    f.input = F32View(inputs_[worker]);
    f.training = step_;
    auto fwd = host_->Forward(id_, f);
    const auto t1 = Clock::now();
    if (!fwd.ok()) {
      o.code = absl::StatusCodeToString(fwd.status().code());
      return o;
    }
    o.stage_seconds[0] = std::chrono::duration<double>(t1 - t0).count();
    o.bytes = int64_t(inputs_[worker].nbytes() + fwd->output.bytes.size());
    if (step_) {
      core::WireBackwardRequest b;
      b.grad_output = F32View(grads_[worker]);
      auto grad = host_->Backward(fwd->context_id, b);
      const auto t2 = Clock::now();
      if (!grad.ok()) {
        o.code = absl::StatusCodeToString(grad.status().code());
        return o;
      }
      o.stage_seconds[1] = std::chrono::duration<double>(t2 - t1).count();
      o.bytes += int64_t(grads_[worker].nbytes() + (*grad ? (*grad)->bytes.size() : 0));
    }
    return o;
  }

 private:
  std::unique_ptr<core::ModuleHost> host_;
  std::string id_;
  bool step_ = false;
  std::vector<at::Tensor> inputs_, grads_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<InProcess>> InProcess::Make(const v1::ModuleSpec& spec,
                                                           const std::string& flow, int64_t rows,
                                                           int workers, uint64_t seed,
                                                           const std::string& device) {
  if (flow != "forward" && flow != "step") {
    return absl::InvalidArgumentError(absl::StrCat("no in-process baseline for flow ", flow));
  }
  auto b = std::make_unique<HostBaseline>();
  if (auto s = b->Init(spec, flow, rows, workers, seed, device); !s.ok()) return s;
  return std::unique_ptr<InProcess>(std::move(b));
}

bool UseServerHeapPolicy() { return core::RetainLargeBlocks(); }

void SetBaselineCpuThreads(int threads, bool gemm_on_blas) {
  device::SetCpuThreads(threads, gemm_on_blas);
}

void SetBaselineCudaStaging(int mib) { device::SetCudaStaging(int64_t(mib) << 20); }

}  // namespace gradwire::load
