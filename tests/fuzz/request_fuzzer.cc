// libFuzzer target: request decoding and validation. The input's first byte picks what the rest
// is: a serialized ForwardRequest, BackwardRequest or SetWeightsRequest, or a raw wire tensor
// (dtype, shape, scale_inv, bytes) built field by field so that byte lengths and shapes are
// mutated independently. Each request goes through the functions the service's handlers call, in
// their order (wire::OutputDType, wire::ViewOf, then the wire forms of ModuleHost::Forward /
// Backward / SetWeights, whose backend decodes and encodes) against a fresh host with one small
// module of each kind.
//
// Beyond crashes and sanitizer reports, it checks what the service promises: only the status
// codes of bad input (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION) or OK come back, a
// viewed tensor has exactly the bytes its shape needs, outputs are encoded with the documented
// shapes and byte counts, and no context or weight change survives a failed call. The one other
// code is a backward's OUT_OF_RANGE, the documented refusal when finite values near FLT_MAX give
// gradients that overflow fp32: it must accumulate nothing, leave the scaling state as it was and
// keep the context for the client to retry or release.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "gradwire/v1/service.pb.h"
#include "gradwire/wire/tensor.h"
#include "server/core/module_host.h"
#include "server/core/tensor_calls.h"

namespace {

using gradwire::core::ModuleHost;
using gradwire::core::ModuleKind;
using gradwire::core::ModuleSpec;
namespace v1 = gradwire::v1;
namespace wire = gradwire::wire;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "request_fuzzer invariant broken: %s\n", what.c_str());
  std::abort();
}

// The codes a malformed request may get; anything else (INTERNAL above all) is a bug.
void CheckBadInputCode(const absl::Status& s, const char* where) {
  switch (s.code()) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
      return;
    default:
      Fail(std::string(where) + " returned " + s.ToString());
  }
}

bool SameScaling(const std::vector<gradwire::core::RoleScaling>& a,
                 const std::vector<gradwire::core::RoleScaling>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].role != b[i].role || a[i].history != b[i].history) return false;
    // Bitwise, so a scale that moved is caught whatever its value.
    if (std::memcmp(&a[i].scale, &b[i].scale, sizeof(float)) != 0) return false;
  }
  return true;
}

struct Fixture {
  ModuleHost host;
  std::vector<std::string> ids;  // Linear, LayerNormLinear (+ln output), LayerNormMLP (swiglu)
  static constexpr int64_t kIn = 8, kOut = 4;

  Fixture() {
    ModuleSpec s;
    s.in_features = kIn;
    s.out_features = kOut;
    s.seed = 7;
    s.kind = ModuleKind::kLinear;
    Add(s);
    s.kind = ModuleKind::kLayerNormLinear;
    s.return_layernorm_output = true;
    s.recipe.mode = gradwire::device::ScalingMode::kDelayed;
    Add(s);
    s.kind = ModuleKind::kLayerNormMlp;
    s.return_layernorm_output = false;
    s.ffn_features = 6;
    s.activation = gradwire::core::Activation::kSwiglu;
    Add(s);
  }
  void Add(const ModuleSpec& s) {
    auto info = host.Create(s);
    if (!info.ok()) Fail("fixture module: " + info.status().ToString());
    ids.push_back(info->module_id);
  }
  // Unknown ids are worth fuzzing too, but mostly the request should reach a real module.
  const std::string& Pick(const std::string& wire_id, uint8_t selector) const {
    for (const std::string& id : ids) {
      if (id == wire_id) return id;
    }
    return selector % 8 == 7 ? wire_id : ids[selector % ids.size()];
  }
  std::vector<gradwire::core::RoleScaling> Scaling(const std::string& module_id) const {
    auto s = host.Scaling(module_id);
    if (!s.ok()) Fail("scaling of a fixture module: " + s.status().ToString());
    return *s;
  }
  // A backward answered OUT_OF_RANGE: nothing accumulated, scaling as before, context kept (and
  // released here).
  void CheckRefusedBackward(const absl::Status& s, const std::string& module_id,
                            const std::string& context_id,
                            const std::vector<gradwire::core::RoleScaling>& scaling_before) {
    if (s.message().find("non-finite") == absl::string_view::npos ||
        s.message().find(context_id) == absl::string_view::npos) {
      Fail("an OUT_OF_RANGE backward does not say why or which context it kept: " + s.ToString());
    }
    auto grads = gradwire::core::TensorGradients(host, module_id, false);
    if (!grads.ok()) Fail("gradients after a refused backward: " + grads.status().ToString());
    for (const auto& [name, g] : grads->tensors) {
      if (g.abs().max().item<float>() != 0.0f) Fail("a refused backward accumulated " + name);
    }
    if (!SameScaling(scaling_before, Scaling(module_id))) {
      Fail("a refused backward moved the scaling state");
    }
    if (!host.ReleaseContext(context_id).ok()) Fail("a refused backward lost its context");
  }
  void CheckNoContexts(const char* where) const {
    if (host.Stats().live_contexts != 0 || host.Stats().context_bytes != 0) {
      Fail(std::string(where) + " left a context behind");
    }
  }
};

// wire::ViewOf plus the checks any success must pass.
absl::StatusOr<wire::TensorView> View(const v1::Tensor& t, const char* field) {
  absl::StatusOr<wire::TensorView> out = wire::ViewOf(t, field);
  CheckBadInputCode(out.status(), "ViewOf");
  if (!out.ok()) {
    if (out.status().code() != absl::StatusCode::kInvalidArgument) Fail("view code");
    if (out.status().message().find(field) == absl::string_view::npos) {
      Fail("view error does not name its field: " + std::string(out.status().message()));
    }
    return out;
  }
  if (int64_t(out->shape.size()) != t.shape_size()) Fail("viewed rank");
  if (out->bytes() != int64_t(t.data().size())) Fail("viewed size");
  for (int i = 0; i < t.shape_size(); ++i) {
    if (out->shape[size_t(i)] != t.shape(i)) Fail("viewed shape");
  }
  // F32 decodes bit-exactly; re-encoding gives the same bytes back.
  if (t.dtype() == v1::F32) {
    std::vector<float> values(static_cast<size_t>(out->numel()));
    wire::DecodeElements(out->dtype, out->data, out->numel(), 1.0f, values.data());
    v1::Tensor again;
    wire::EncodeToMessage(values.data(), out->shape, wire::DType::kF32, &again);
    if (again.data() != t.data()) Fail("F32 decode/encode round trip");
  }
  return out;
}

void CheckEncoded(const wire::EncodedTensor& e, wire::DType dtype, int64_t rows, int64_t cols,
                  const char* what) {
  int64_t n = 1;
  for (int64_t d : e.shape) n *= d;
  if (e.dtype != dtype || e.shape.empty() || e.shape.back() != cols || n != rows * cols ||
      int64_t(e.bytes.size()) != n * wire::ElementSize(dtype)) {
    Fail(std::string(what) + ": encoded shape, dtype or size");
  }
}

void RunForward(Fixture& f, v1::ForwardRequest req, uint8_t selector) {
  req.set_module_id(f.Pick(req.module_id(), selector));
  if (!req.has_input()) return;  // the handler answers before any decoding
  const absl::StatusOr<wire::DType> dtype = wire::OutputDType(req.output_dtype(), "output_dtype");
  CheckBadInputCode(dtype.status(), "OutputDType");
  if (!dtype.ok()) return;
  gradwire::core::WireForwardRequest fwd;
  absl::StatusOr<wire::TensorView> input = View(req.input(), "input");
  if (!input.ok()) return;
  fwd.input = *input;
  fwd.training = req.training();
  fwd.output_dtype = *dtype;
  const std::string module_id = req.module_id();
  const bool known = std::find(f.ids.begin(), f.ids.end(), module_id) != f.ids.end();
  const auto scaling_before =
      known ? f.Scaling(module_id) : std::vector<gradwire::core::RoleScaling>{};
  auto out = f.host.Forward(req.module_id(), fwd);
  if (out.status().code() == absl::StatusCode::kOutOfRange) {
    // Finite values near FLT_MAX may overflow on the way (a LayerNorm's sum, an FC1 output): the
    // documented refusal, which must say so, leave no context and move no history.
    if (out.status().message().find("non-finite") == absl::string_view::npos) {
      Fail("an OUT_OF_RANGE forward does not say why: " + out.status().ToString());
    }
    if (known && !SameScaling(scaling_before, f.Scaling(module_id))) {
      Fail("a refused forward moved the scaling state");
    }
    f.CheckNoContexts("refused Forward");
    return;
  }
  CheckBadInputCode(out.status(), "Forward");
  if (!out.ok()) {
    f.CheckNoContexts("failed Forward");
    return;
  }
  const int64_t rows = input->numel() / Fixture::kIn;
  CheckEncoded(out->output, *dtype, rows, Fixture::kOut, "forward output");
  if (out->output.shape.size() != input->shape.size()) Fail("forward output rank");
  if (out->has_layernorm_output) {
    CheckEncoded(out->layernorm_output, *dtype, rows, Fixture::kIn, "layernorm output");
  }
  if (req.training() == out->context_id.empty()) Fail("context id vs training");
  if (!out->context_id.empty()) {
    // A backward of the right shape on the context must work (and free it), whatever the input.
    std::vector<float> ones(size_t(rows * Fixture::kOut), 1.0f);
    gradwire::core::WireBackwardRequest back;
    back.grad_output.data = ones.data();
    back.grad_output.shape = out->output.shape;
    back.skip_grad_input = selector & 1;
    const auto scaling_before = f.Scaling(req.module_id());
    auto grad = f.host.Backward(out->context_id, back);
    if (grad.status().code() == absl::StatusCode::kOutOfRange) {
      // The fuzzed input may hold finite values near FLT_MAX.
      f.CheckRefusedBackward(grad.status(), req.module_id(), out->context_id, scaling_before);
    } else if (!grad.ok()) {
      Fail("backward after a fuzzed forward: " + grad.status().ToString());
    } else if (grad->has_value() == back.skip_grad_input) {
      Fail("grad_input vs skip_grad_input");
    }
    f.CheckNoContexts("Backward");
  }
}

void RunBackward(Fixture& f, v1::BackwardRequest req, uint8_t selector) {
  // A real context from a valid forward, so the fuzzed grad_output meets the shape checks.
  const std::string& module_id = f.ids[selector % f.ids.size()];
  const int64_t rows = 1 + (selector >> 4) % 4;
  auto fwd = gradwire::core::TensorForward(f.host, module_id, at::rand({rows, Fixture::kIn}), true);
  if (!fwd.ok()) Fail("fixture forward: " + fwd.status().ToString());
  if (!(selector & 8)) req.set_context_id(fwd->context_id);
  const auto version_before = f.host.Info(module_id)->weight_version;
  const auto scaling_before = f.Scaling(module_id);
  absl::Status status = absl::OkStatus();
  gradwire::core::WireBackwardRequest in;
  if (!req.has_grad_output()) {
    status = absl::InvalidArgumentError("grad_output is required");
  } else if (auto d = wire::OutputDType(req.grad_input_dtype(), "grad_input_dtype"); !d.ok()) {
    status = d.status();
  } else {
    in.grad_input_dtype = *d;
    absl::StatusOr<wire::TensorView> grad = View(req.grad_output(), "grad_output");
    if (grad.ok()) in.grad_output = *grad;
    absl::StatusOr<wire::TensorView> grad_ln = wire::TensorView{};
    if (grad.ok() && req.has_grad_layernorm_output()) {
      grad_ln = View(req.grad_layernorm_output(), "grad_layernorm_output");
      if (grad_ln.ok()) in.grad_layernorm_output = *grad_ln;
    }
    status = !grad.ok() ? grad.status() : !grad_ln.ok() ? grad_ln.status() : absl::OkStatus();
    if (status.ok()) {
      in.retain = req.retain();
      in.skip_grad_input = req.skip_grad_input();
      in.grad_output_column_sums.assign(req.grad_output_column_sums().begin(),
                                        req.grad_output_column_sums().end());
      auto back = f.host.Backward(req.context_id(), in);
      status = back.status();
      if (back.ok() && !in.skip_grad_input) {
        if (!back->has_value()) Fail("grad_input missing");
        CheckEncoded(**back, in.grad_input_dtype, rows, Fixture::kIn, "grad_input");
      }
    }
  }
  if (status.code() == absl::StatusCode::kOutOfRange) {
    f.CheckRefusedBackward(status, module_id, req.context_id(), scaling_before);
  } else {
    CheckBadInputCode(status, "Backward");
  }
  if (f.host.Info(module_id)->weight_version != version_before) Fail("backward changed weights");
  // A failed backward keeps the context (the client may retry); release whatever is left.
  (void)f.host.ReleaseContext(fwd->context_id);
  f.CheckNoContexts("Backward + release");
}

void RunSetWeights(Fixture& f, v1::SetWeightsRequest req, uint8_t selector) {
  req.set_module_id(f.Pick(req.module_id(), selector));
  auto before = gradwire::core::TensorWeights(f.host, req.module_id());
  gradwire::core::NamedViews params;
  absl::Status status = absl::OkStatus();
  for (int i = 0; i < req.parameters_size() && status.ok(); ++i) {
    auto t = View(req.parameters(i).tensor(), "parameters[i].tensor");
    if (t.ok()) {
      params.emplace_back(req.parameters(i).name(), *t);
    } else {
      status = t.status();
    }
  }
  if (status.ok()) status = f.host.SetWeights(req.module_id(), params).status();
  CheckBadInputCode(status, "SetWeights");
  if (!status.ok() && before.ok()) {
    auto after = gradwire::core::TensorWeights(f.host, req.module_id());
    if (!after.ok() || after->weight_version != before->weight_version) Fail("version moved");
    for (size_t i = 0; i < before->tensors.size(); ++i) {
      if (!at::equal(before->tensors[i].second, after->tensors[i].second)) {
        Fail("a rejected SetWeights changed " + before->tensors[i].first);
      }
    }
  }
}

// Raw tensor: [dtype][rank][rank x int64 dims, little-endian][scale_inv f32][data...].
void RunRawTensor(Fixture& f, const uint8_t* data, size_t size, uint8_t selector) {
  if (size < 2) return;
  v1::Tensor t;
  t.set_dtype(static_cast<v1::DType>(int8_t(data[0])));
  const size_t rank = data[1] % 6;
  data += 2, size -= 2;
  for (size_t i = 0; i < rank; ++i) {
    int64_t dim = 0;
    if (size < sizeof(dim)) return;
    std::memcpy(&dim, data, sizeof(dim));
    data += sizeof(dim), size -= sizeof(dim);
    t.add_shape(dim);
  }
  float scale_inv = 0;
  if (size < sizeof(scale_inv)) return;
  std::memcpy(&scale_inv, data, sizeof(scale_inv));
  data += sizeof(scale_inv), size -= sizeof(scale_inv);
  t.set_scale_inv(scale_inv);
  t.set_data(reinterpret_cast<const char*>(data), size);
  v1::ForwardRequest req;
  *req.mutable_input() = std::move(t);
  req.set_training(selector & 1);
  req.set_output_dtype(static_cast<v1::DType>((selector >> 1) % 6));
  RunForward(f, std::move(req), selector >> 4);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  // Parsing fuzzed bytes makes protobuf log every invalid UTF-8 string; the parse result is
  // what matters.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t mode = data[0] % 4, selector = data[1];
  data += 2, size -= 2;
  Fixture f;
  switch (mode) {
    case 0: {
      v1::ForwardRequest req;
      if (req.ParseFromArray(data, int(size))) RunForward(f, std::move(req), selector);
      break;
    }
    case 1: {
      v1::BackwardRequest req;
      if (req.ParseFromArray(data, int(size))) RunBackward(f, std::move(req), selector);
      break;
    }
    case 2: {
      v1::SetWeightsRequest req;
      if (req.ParseFromArray(data, int(size))) RunSetWeights(f, std::move(req), selector);
      break;
    }
    default:
      RunRawTensor(f, data, size, selector);
  }
  f.CheckNoContexts("end of input");
  return 0;
}
