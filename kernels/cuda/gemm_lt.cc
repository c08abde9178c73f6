#include "gradwire/kernels/cuda/gemm_lt.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "check.h"

namespace gradwire::kernels::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // what cuBLASLt suggests for Hopper
constexpr uint32_t kAlignment = 16;
constexpr int kMaxDevices = 64;

cudaDataType_t Fp8Type(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}
cudaDataType_t OutType(GemmOut type) {
  return type == GemmOut::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlignment == 0; }

// The descriptors of one shape and the algorithm the heuristic chose for it. The pointer
// attributes (scales, bias) are set per call under `mu`; cublasLtMatmul reads the descriptor
// during the call only, so the lock is held just for setting them and enqueuing.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr;  // cuBLASLt's A = our B, [k x n] column-major
  cublasLtMatrixLayout_t b = nullptr;  // cuBLASLt's B = our A, [k x m] column-major
  cublasLtMatrixLayout_t d = nullptr;  // [n x m] column-major = our D [m, n] row-major
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::mutex mu;
  ~Plan() {  // in reverse order of creation; errors cannot be reported from here
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

struct Registry {
  std::mutex mu;
  cublasLtHandle_t handles[kMaxDevices] = {};
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;
  std::unordered_map<LtPlanKey, std::unique_ptr<Plan>, LtPlanKeyHash> plans;
};

// Lives for the process: handles, workspaces and plans are reused until exit and never torn down
// (destroying them after the CUDA context at exit would fail).
Registry& TheRegistry() {
  static Registry* registry = new Registry;
  return *registry;
}

cublasLtHandle_t HandleLocked(Registry& reg, int device) {
  if (!reg.handles[device]) GRADWIRE_CUBLAS_CHECK(cublasLtCreate(&reg.handles[device]));
  return reg.handles[device];
}

void* WorkspaceLocked(Registry& reg, int device, cudaStream_t stream) {
  void*& ws = reg.workspaces[{device, stream}];
  if (!ws) GRADWIRE_CUDA_CHECK(cudaMalloc(&ws, kWorkspaceBytes));
  return ws;
}

template <class T>
void SetAttr(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const T& value) {
  GRADWIRE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, attr, &value, sizeof value));
}

cublasLtEpilogue_t EpilogueOf(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    default:
      return CUBLASLT_EPILOGUE_DEFAULT;
  }
}

// Sets what changes per call: the scale pointers and the bias pointer.
void SetPointers(Plan& plan, const LtGemmArgs& args) {
  SetAttr(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, args.b_scale_inv);
  SetAttr(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, args.a_scale_inv);
  if (args.epilogue != GemmEpilogue::kNone) {
    SetAttr(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(args.bias));
  }
}

std::unique_ptr<Plan> BuildPlan(cublasLtHandle_t handle, const LtGemmArgs& args) {
  auto plan = std::make_unique<Plan>();
  GRADWIRE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  SetAttr(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  SetAttr(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  SetAttr(plan->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
          int8_t(args.accumulation == GemmAccumulation::kFast ? 1 : 0));
  SetAttr(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, EpilogueOf(args.epilogue));
  if (args.epilogue != GemmEpilogue::kNone) {
    SetAttr(plan->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(CUDA_R_16BF));
  }
  SetPointers(*plan, args);  // the heuristic reads the pointers' alignment
  const uint64_t m = uint64_t(args.m), n = uint64_t(args.n), k = uint64_t(args.k);
  GRADWIRE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, Fp8Type(args.b_format), k, n, k));
  GRADWIRE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, Fp8Type(args.a_format), k, m, k));
  GRADWIRE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, OutType(args.d_type), n, m, n));
  GRADWIRE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&plan->pref));
  GRADWIRE_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(plan->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &kWorkspaceBytes, sizeof kWorkspaceBytes));
  // Promise only 16-byte alignment, so the chosen algorithm serves every pointer the checks let in.
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    GRADWIRE_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(plan->pref, attr, &kAlignment, sizeof kAlignment));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  GRADWIRE_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, plan->op, plan->a, plan->b, plan->d,
                                                       plan->d, plan->pref, 1, &result, &found));
  if (found == 0) {
    throw std::runtime_error(
        "Fp8GemmLt: cuBLASLt has no algorithm for m=" + std::to_string(args.m) +
        " n=" + std::to_string(args.n) + " k=" + std::to_string(args.k) +
        " a=" + Fp8FormatName(args.a_format) + " b=" + Fp8FormatName(args.b_format) +
        " epilogue=" + std::to_string(int(args.epilogue)));
  }
  plan->algo = result.algo;
  return plan;
}

}  // namespace

bool LtPlanKey::operator==(const LtPlanKey& o) const {
  return m == o.m && n == o.n && k == o.k && a_format == o.a_format && b_format == o.b_format &&
         d_type == o.d_type && epilogue == o.epilogue && accumulation == o.accumulation &&
         accumulate == o.accumulate && device == o.device;
}

size_t LtPlanKeyHash::operator()(const LtPlanKey& key) const {
  // Boost-style mixing of each field's hash.
  size_t h = 0;
  auto mix = [&h](size_t v) { h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2); };
  mix(std::hash<int64_t>()(key.m));
  mix(std::hash<int64_t>()(key.n));
  mix(std::hash<int64_t>()(key.k));
  mix(size_t(key.a_format));
  mix(size_t(key.b_format));
  mix(size_t(key.d_type));
  mix(size_t(key.epilogue));
  mix(size_t(key.accumulation));
  mix(size_t(key.accumulate));
  mix(std::hash<int>()(key.device));
  return h;
}

LtPlanKey PlanKeyOf(const LtGemmArgs& args, int device) {
  LtPlanKey key;
  key.m = args.m;
  key.n = args.n;
  key.k = args.k;
  key.a_format = args.a_format;
  key.b_format = args.b_format;
  key.d_type = args.d_type;
  key.epilogue = args.epilogue;
  key.accumulation = args.accumulation;
  key.accumulate = args.accumulate;
  key.device = device;
  return key;
}

std::string ValidateLtGemm(const LtGemmArgs& args) {
  const std::pair<const char*, int64_t> dims[] = {{"m", args.m}, {"n", args.n}, {"k", args.k}};
  for (const auto& [name, value] : dims) {
    if (value <= 0 || value % 16 != 0) {
      return std::string("Fp8GemmLt: ") + name + "=" + std::to_string(value) +
             " must be a positive multiple of 16 (FP8 tensor-core GEMM; pad the operands)";
    }
    if (value > 0x7FFFFFFF) {
      return std::string("Fp8GemmLt: ") + name + "=" + std::to_string(value) + " is too large";
    }
  }
  if (args.a_format == Fp8Format::kE5M2 && args.b_format == Fp8Format::kE5M2) {
    return "Fp8GemmLt: E5M2 x E5M2 has no FP8 tensor-core kernel (one operand must be E4M3)";
  }
  if (!args.a || !args.b || !args.d || !args.a_scale_inv || !args.b_scale_inv) {
    return "Fp8GemmLt: a, b, d, a_scale_inv and b_scale_inv must not be null";
  }
  if (!Aligned(args.a) || !Aligned(args.b) || !Aligned(args.d)) {
    return "Fp8GemmLt: a, b and d must be 16-byte aligned";
  }
  // Measured on an H100 (cuBLASLt 13.0): a scale_inv 4 bytes past a 16-byte boundary makes
  // cublasLtMatmul answer CUBLAS_STATUS_NOT_SUPPORTED after the heuristic accepted the plan.
  if (!Aligned(args.a_scale_inv) || !Aligned(args.b_scale_inv)) {
    return "Fp8GemmLt: a_scale_inv and b_scale_inv must be 16-byte aligned";
  }
  if (args.epilogue == GemmEpilogue::kBias && (!args.bias || !Aligned(args.bias))) {
    return "Fp8GemmLt: the bias epilogue needs a 16-byte aligned bf16 bias";
  }
  if (args.epilogue == GemmEpilogue::kNone && args.bias) {
    return "Fp8GemmLt: a bias was given without the bias epilogue";
  }
  if (int(args.epilogue) > int(GemmEpilogue::kBias) || int(args.d_type) > 1 ||
      int(args.accumulation) > 1) {
    return "Fp8GemmLt: an enum argument is out of range";
  }
  return "";
}

void Fp8GemmLt(const LtGemmArgs& args) {
  if (std::string why = ValidateLtGemm(args); !why.empty()) throw std::invalid_argument(why);
  int device = 0;
  GRADWIRE_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) {
    throw std::runtime_error("Fp8GemmLt: device " + std::to_string(device) + " out of range");
  }
  Registry& reg = TheRegistry();
  const LtPlanKey key = PlanKeyOf(args, device);
  cublasLtHandle_t handle;
  void* workspace;
  Plan* plan;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    handle = HandleLocked(reg, device);
    workspace = WorkspaceLocked(reg, device, args.stream);
    auto it = reg.plans.find(key);
    if (it == reg.plans.end()) it = reg.plans.emplace(key, BuildPlan(handle, args)).first;
    plan = it->second.get();  // plans are never erased, so the pointer stays valid
  }
  const float alpha = 1.0f;
  const float beta = args.accumulate ? 1.0f : 0.0f;
  std::lock_guard<std::mutex> lock(plan->mu);
  SetPointers(*plan, args);
  GRADWIRE_CUBLAS_CHECK(cublasLtMatmul(handle, plan->op, &alpha, args.b, plan->a, args.a, plan->b,
                                       &beta, args.d, plan->d, args.d, plan->d, &plan->algo,
                                       workspace, kWorkspaceBytes, args.stream));
}

size_t LtPlanCount() {
  Registry& reg = TheRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  return reg.plans.size();
}

}  // namespace gradwire::kernels::cuda
