#include "server/core/host/module.h"

#include <ATen/ATen.h>

#include <cmath>
#include <stdexcept>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/kernels/random.h"
#include "server/common/status_macros.h"

namespace gradwire::core {

namespace {

at::TensorOptions Float32() { return at::TensorOptions().dtype(at::kFloat); }

}  // namespace

std::string ShapeString(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status CheckExactShape(const char* field, const at::Tensor& t, at::IntArrayRef expected,
                             bool bf16_ok) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  if (t.scalar_type() != at::kFloat && !(bf16_ok && t.scalar_type() == at::kBFloat16)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be float32"));
  }
  if (t.sizes() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape must be ", ShapeString(expected),
                                                   ", got ", ShapeString(t.sizes())));
  }
  return absl::OkStatus();
}

bool AllFinite(const at::Tensor& t) { return t.numel() == 0 || at::isfinite(t).all().item<bool>(); }

absl::Status CheckFinite(const std::string& field, const at::Tensor& t) {
  if (AllFinite(t)) return absl::OkStatus();
  const at::Tensor flat = t.reshape(-1);
  const int64_t i = at::nonzero(at::logical_not(at::isfinite(flat)))[0][0].item<int64_t>();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be finite; element ", i, " is ", flat[i].item<float>()));
}

wire::EncodedTensor EncodeHost(const at::Tensor& t, wire::DType dtype) {
  const at::Tensor c = t.contiguous();
  wire::EncodedTensor e;
  e.dtype = dtype;
  e.shape.assign(c.sizes().begin(), c.sizes().end());
  e.bytes.resize(size_t(c.numel() * wire::ElementSize(dtype)));
  e.scale_inv = wire::EncodeTensor(c.data_ptr<float>(), c.numel(), dtype, e.bytes.data());
  return e;
}

absl::Status CheckViewShape(const char* field, const wire::TensorView& v, int64_t last_dim,
                            const char* what) {
  if (v.shape.empty() || v.shape.back() != last_dim || v.numel() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape must be [..., ", last_dim,
                                                   "] (the module's ", what, "), got [",
                                                   absl::StrJoin(v.shape, ", "), "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckViewExactShape(const char* field, const wire::TensorView& v,
                                 const std::vector<int64_t>& expected) {
  if (v.shape != expected) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape must be ", ShapeString(expected),
                                                   ", got ", ShapeString(v.shape)));
  }
  return absl::OkStatus();
}

GradAccumulator* ModuleGradients::Accumulator(Param id) {
  for (Entry& e : list) {
    if (e.id == id) return &e.grad;
  }
  throw std::logic_error(absl::StrCat("the kind gave a gradient of ", ParamName(id),
                                      ", which this module does not have"));
}

absl::StatusOr<ModulePtr> NewModule(const ModuleSpec& spec, const Backend& backend) {
  GW_RETURN_IF_ERROR(ValidateModuleSpec(spec));
  // The CUDA backend has no block-scaled GEMM yet (docs/block-scaling.md, docs/cuda.md).
  if (BlockScaled(spec.recipe.mode) && std::string_view(backend.name()) == "cuda") {
    return absl::FailedPreconditionError(absl::StrCat(
        "spec.recipe.scaling ", absl::AsciiStrToUpper(ScalingModeName(spec.recipe.mode)),
        " is not supported on --device cuda yet; use --device cpu, or the CURRENT or DELAYED "
        "recipe"));
  }
  auto m = std::make_shared<Module>();
  m->spec = spec;
  m->kind = FindKind(spec.kind);  // valid: ValidateModuleSpec checked it
  m->backend = &backend;
  uint64_t stream = 0;  // one random stream per parameter, in order
  for (const ParamDef& d : m->kind->Params(spec)) {
    ModuleWeights::Weight p;
    p.id = d.param;
    p.name = ParamName(d.param);
    p.value = at::empty(d.shape, Float32());
    switch (d.init) {
      case ParamDef::Init::kUniform: {
        const float bound = 1.0f / std::sqrt(float(d.fan_in));
        kernels::FillUniform(p.value.data_ptr<float>(), p.value.numel(), spec.seed, stream, -bound,
                             bound);
        break;
      }
      case ParamDef::Init::kOnes:
        p.value.fill_(1.0f);
        break;
      case ParamDef::Init::kZeros:
        p.value.fill_(0.0f);
        break;
    }
    ++stream;
    ModuleGradients::Entry g;
    g.id = d.param;
    g.grad.grad = backend.Zeros(d.shape);
    m->weights.list.push_back(std::move(p));
    m->gradients.list.push_back(std::move(g));
  }
  std::vector<kernels::Fp8Format> formats;
  for (const RoleDef& r : m->kind->Roles()) formats.push_back(r.format);
  m->steps.scaling.emplace(backend, std::move(formats), spec.recipe);
  return m;
}

}  // namespace gradwire::core
