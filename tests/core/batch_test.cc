// ModuleHost::ForwardBatch and BackwardBatch: forwards of many requests as one backend call, bit
// for bit what each request gets alone (inference) or in the sequence of its requests (training:
// outputs, scaling state, and each context through its backward) (docs/batching.md). Every kind x
// recipe (the block-scaled ones too) x wire dtype, batches of 1-16 requests of 1-300 rows, on the
// reference backend and the CPU backend under both of its GEMMs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "queued_reads_backend.h"
#include "server/core/module_host.h"
#include "server/core/tensor_calls.h"
#include "server/device/cpu_gemm.h"
#include "server/device/reference_backend.h"
#include "test_util.h"

namespace gradwire::testing {
namespace {

using core::ModuleKind;
using wire::DType;

std::mt19937& Rng() {
  static std::mt19937 rng(std::random_device{}());
  return rng;
}

// One request's input, encoded as it would arrive, and the view ForwardBatch reads.
struct WireInput {
  std::string bytes;
  core::WireForwardRequest req;
};

WireInput Encode(const at::Tensor& x, DType dtype, DType output_dtype) {
  WireInput w;
  const at::Tensor c = x.contiguous();
  w.bytes.resize(size_t(c.numel() * wire::ElementSize(dtype)));
  w.req.input.dtype = dtype;
  w.req.input.scale_inv = wire::EncodeTensor(c.data_ptr<float>(), c.numel(), dtype, w.bytes.data());
  w.req.input.data = w.bytes.data();
  w.req.input.shape.assign(c.sizes().begin(), c.sizes().end());
  w.req.output_dtype = output_dtype;
  return w;
}

::testing::AssertionResult SameEncoding(const wire::EncodedTensor& a,
                                        const wire::EncodedTensor& b) {
  if (a.dtype != b.dtype || a.shape != b.shape) {
    return ::testing::AssertionFailure() << "dtype or shape differs";
  }
  if (std::memcmp(&a.scale_inv, &b.scale_inv, sizeof(float)) != 0) {
    return ::testing::AssertionFailure() << "scale_inv " << a.scale_inv << " vs " << b.scale_inv;
  }
  if (a.bytes != b.bytes) return ::testing::AssertionFailure() << "bytes differ";
  return ::testing::AssertionSuccess();
}

struct Case {
  const char* backend;  // "reference", "cpu-blas", "cpu-ordered", "cuda"
  ModuleKind kind;
  device::ScalingMode mode;
  DType dtype;
  bool delayed() const { return mode == device::ScalingMode::kDelayed; }
};

// Every recipe: per tensor (current, delayed) and block-scaled (BLOCK, MXFP8), whose requests'
// row counts (1 to 300) are mostly not multiples of the blocks' 128 or 32.
const device::ScalingMode kModes[] = {device::ScalingMode::kCurrent, device::ScalingMode::kDelayed,
                                      device::ScalingMode::kBlock, device::ScalingMode::kMxfp8};

std::string Name(const Case& c) {
  return std::string(c.backend) + " " + core::ModuleKindName(c.kind) + " " +
         device::ScalingModeName(c.mode) + " " + wire::DTypeName(c.dtype);
}

// Whether this machine runs the CUDA backend (a GPU and a libtorch with CUDA; not in CI).
bool HaveCuda() {
  static const bool have = device::MakeCudaBackend(0).ok();
  return have;
}

// Every backend x kind x recipe x one of `dtypes`; with `cuda`, the CUDA backend too where it
// runs (only where its results are deterministic: its LayerNorm parameter gradients sum with
// float atomics, so a training batch cannot be held bit for bit to a sequence there).
std::vector<Case> Cases(std::initializer_list<DType> dtypes, bool cuda = false) {
  std::vector<Case> out;
  std::vector<const char*> backends = {"reference", "cpu-blas", "cpu-ordered"};
  if (cuda && HaveCuda()) backends.push_back("cuda");
  for (const char* backend : backends) {
    for (ModuleKind kind :
         {ModuleKind::kLinear, ModuleKind::kLayerNormLinear, ModuleKind::kLayerNormMlp}) {
      for (device::ScalingMode mode : kModes) {
        // The CUDA backend refuses the block-scaled recipes (docs/block-scaling.md).
        if (device::BlockScaled(mode) && std::string(backend) == "cuda") continue;
        for (DType dtype : dtypes) out.push_back({backend, kind, mode, dtype});
      }
    }
  }
  return out;
}

device::BackendPtr BackendFor(const std::string& name) {
  if (name == "reference") return device::MakeReferenceBackend();
  if (name == "cuda") return *device::MakeCudaBackend(0);
  device::SetCpuGemm(name == "cpu-ordered" ? device::CpuGemm::kOrdered : device::CpuGemm::kBlas);
  return device::MakeCpuBackend();
}

core::ModuleSpec SpecFor(const Case& c, uint64_t seed) {
  core::ModuleSpec spec = MakeModuleSpec(c.kind, 40, 24, 56, seed);
  if (c.kind != ModuleKind::kLinear) spec.return_layernorm_output = seed % 2 == 0;
  if (c.delayed()) spec.recipe = DelayedRecipe(device::AmaxAlgo::kMax, 4);
  spec.recipe.mode = c.mode;
  return spec;
}

class ForwardBatchTest : public ::testing::Test {
 protected:
  void TearDown() override { device::SetCpuGemm(device::CpuGemm::kOrdered); }
};

TEST_F(ForwardBatchTest, EveryRequestGetsTheBitsItGetsAlone) {
  const auto dtypes = {DType::kF32, DType::kBF16, DType::kF16, DType::kFp8E4M3, DType::kFp8E5M2};
  const DType outputs[] = {DType::kF32, DType::kBF16, DType::kFp8E4M3};
  std::uniform_int_distribution<int> requests(1, 16), rows(1, 300), pick(0, 2);
  int cases = 0;
  // On a GPU machine (GRADWIRE_TEST_DEVICE=cuda, as scripts/device/gpu-check.sh runs it) the CUDA
  // rows must run, not quietly drop out.
  const char* device = std::getenv("GRADWIRE_TEST_DEVICE");
  if (device != nullptr && std::string(device) == "cuda") {
    ASSERT_TRUE(HaveCuda()) << "GRADWIRE_TEST_DEVICE=cuda but the CUDA backend cannot run";
  }
  for (const Case& c : Cases(dtypes, /*cuda=*/true)) {
    SCOPED_TRACE(Name(c));
    core::ModuleHost host(core::ContextLimits{}, nullptr, BackendFor(c.backend));
    auto info = host.Create(SpecFor(c, uint64_t(cases)));
    ASSERT_TRUE(info.ok()) << info.status();
    const std::string id = info->module_id;
    // Delayed scaling: a few training forwards first, so the scales are not their
    // initial 1 (inference then leaves them alone).
    if (c.delayed()) {
      for (int i = 0; i < 3; ++i) {
        auto f = core::TensorForward(host, id, RandN({5, 40}, 1.0 + i), true);
        ASSERT_TRUE(f.ok()) << f.status();
        ASSERT_TRUE(host.ReleaseContext(f->context_id).ok());
      }
    }
    const int n = cases % 5 == 0 ? 1 : requests(Rng());
    std::vector<WireInput> inputs;
    for (int i = 0; i < n; ++i) {
      // Mixed magnitudes: each request's own amax sets its scale.
      const at::Tensor x = RandN({rows(Rng()) > 250 ? 2 : 1, rows(Rng()) / 2 + 1, 40},
                                 std::pow(4.0, double(i % 5) - 2.0));
      inputs.push_back(Encode(x, c.dtype, outputs[pick(Rng())]));
    }
    std::vector<const core::WireForwardRequest*> reqs;
    for (const WireInput& w : inputs) reqs.push_back(&w.req);
    const int64_t before = host.Stats().batched_forwards;
    const auto batched = host.ForwardBatch(id, reqs);
    ASSERT_EQ(batched.size(), inputs.size());
    EXPECT_EQ(host.Stats().batched_forwards - before, n > 1 ? n : 0);
    for (int i = 0; i < n; ++i) {
      auto alone = host.Forward(id, inputs[size_t(i)].req);
      ASSERT_TRUE(alone.ok()) << alone.status();
      ASSERT_TRUE(batched[size_t(i)].ok()) << batched[size_t(i)].status();
      EXPECT_TRUE(SameEncoding(batched[size_t(i)]->output, alone->output))
          << "request " << i << " of " << n;
      EXPECT_EQ(batched[size_t(i)]->has_layernorm_output, alone->has_layernorm_output);
      if (alone->has_layernorm_output) {
        EXPECT_TRUE(SameEncoding(batched[size_t(i)]->layernorm_output, alone->layernorm_output))
            << "request " << i;
      }
      EXPECT_TRUE(batched[size_t(i)]->context_id.empty());
      EXPECT_EQ(batched[size_t(i)]->weight_version, alone->weight_version);
    }
    ++cases;
  }
  EXPECT_EQ(cases, 3 * 3 * 4 * 5 + (HaveCuda() ? 3 * 2 * 5 : 0));
}

// A bf16 response: the module's output comes back in bf16 (FpropBf16), alone and in a batch
// whose every request wants bf16 (NarrowBf16 of the batch's GEMM). Either way the bytes are the
// fp32 response's values rounded as the wire codec rounds, and so is the LayerNorm output.
TEST_F(ForwardBatchTest, ABf16ResponseIsTheF32OutputRounded) {
  auto rounded = [](const wire::EncodedTensor& f32) {
    std::vector<float> values(f32.bytes.size() / 4);
    std::memcpy(values.data(), f32.bytes.data(), f32.bytes.size());
    std::string out(values.size() * 2, '\0');
    wire::EncodeElements(values.data(), int64_t(values.size()), DType::kBF16, 1.0f, out.data());
    return out;
  };
  int cases = 0;
  for (const Case& c : Cases({DType::kF32, DType::kBF16})) {
    SCOPED_TRACE(Name(c));
    core::ModuleHost host(core::ContextLimits{}, nullptr, BackendFor(c.backend));
    auto info = host.Create(SpecFor(c, uint64_t(cases)));
    ASSERT_TRUE(info.ok()) << info.status();
    const std::string id = info->module_id;
    std::vector<WireInput> as_bf16, as_f32;
    for (int i = 0; i < 4; ++i) {
      const at::Tensor x = RandN({i + 1, 40}, std::pow(4.0, double(i) - 2.0));
      as_bf16.push_back(Encode(x, c.dtype, DType::kBF16));
      as_f32.push_back(Encode(x, c.dtype, DType::kF32));
    }
    std::vector<const core::WireForwardRequest*> reqs;
    for (const WireInput& w : as_bf16) reqs.push_back(&w.req);
    const auto batched = host.ForwardBatch(id, reqs);  // inference: the state stays as it is
    ASSERT_EQ(batched.size(), as_bf16.size());
    for (size_t i = 0; i < as_bf16.size(); ++i) {
      auto f32 = host.Forward(id, as_f32[i].req);
      auto bf16 = host.Forward(id, as_bf16[i].req);
      ASSERT_TRUE(f32.ok()) << f32.status();
      ASSERT_TRUE(bf16.ok()) << bf16.status();
      ASSERT_TRUE(batched[i].ok()) << batched[i].status();
      const std::string want = rounded(f32->output);
      EXPECT_EQ(bf16->output.dtype, DType::kBF16);
      EXPECT_EQ(bf16->output.shape, f32->output.shape);
      EXPECT_TRUE(bf16->output.bytes == want) << "request " << i << " alone";
      EXPECT_TRUE(batched[i]->output.bytes == want) << "request " << i << " in the batch";
      EXPECT_EQ(batched[i]->batch_requests, 4) << "request " << i << " ran alone";
      if (f32->has_layernorm_output) {
        EXPECT_TRUE(bf16->layernorm_output.bytes == rounded(f32->layernorm_output));
        EXPECT_TRUE(batched[i]->layernorm_output.bytes == rounded(f32->layernorm_output));
      }
    }
    ++cases;
  }
  EXPECT_EQ(cases, 3 * 3 * 4 * 2);
}

TEST_F(ForwardBatchTest, TrainingBatchesAreTheSequenceOfTheirRequests) {
  // Two identical modules: one runs the batch, the other the same requests one after another.
  // Outputs, the scaling state after, and each context (through its backward: grad_input and
  // the accumulated gradients) must match bit for bit.
  const auto dtypes = {DType::kF32, DType::kBF16, DType::kFp8E4M3};
  std::uniform_int_distribution<int> requests(2, 16), rows(1, 300);
  int cases = 0;
  for (const Case& c : Cases(dtypes)) {
    SCOPED_TRACE(Name(c));
    core::ModuleSpec spec = SpecFor(c, uint64_t(cases));
    spec.checkpoint = c.kind != ModuleKind::kLinear && cases % 2 == 1;
    core::ModuleHost batched(core::ContextLimits{}, nullptr, BackendFor(c.backend));
    core::ModuleHost sequential(core::ContextLimits{}, nullptr, BackendFor(c.backend));
    auto a = batched.Create(spec);
    auto b = sequential.Create(spec);
    ASSERT_TRUE(a.ok() && b.ok());
    const int n = requests(Rng());
    std::vector<WireInput> inputs;
    for (int i = 0; i < n; ++i) {
      const at::Tensor x = RandN({rows(Rng()), 40}, std::pow(4.0, double((i + cases) % 5) - 2.0));
      inputs.push_back(Encode(x, c.dtype, i % 2 ? DType::kBF16 : DType::kF32));
      inputs.back().req.training = true;
    }
    std::vector<const core::WireForwardRequest*> reqs;
    for (const WireInput& w : inputs) reqs.push_back(&w.req);
    const auto together = batched.ForwardBatch(a->module_id, reqs);
    ASSERT_EQ(together.size(), size_t(n));
    EXPECT_EQ(batched.Stats().live_contexts, n);
    // Computed as one batch, a Linear's FP8 codes too (each request's codes its own input cast).
    EXPECT_EQ(batched.Stats().batched_forwards, n);
    for (int i = 0; i < n; ++i) {
      auto alone = sequential.Forward(b->module_id, inputs[size_t(i)].req);
      ASSERT_TRUE(alone.ok()) << alone.status();
      ASSERT_TRUE(together[size_t(i)].ok()) << together[size_t(i)].status();
      EXPECT_TRUE(SameEncoding(together[size_t(i)]->output, alone->output)) << "request " << i;
      if (alone->has_layernorm_output) {
        EXPECT_TRUE(SameEncoding(together[size_t(i)]->layernorm_output, alone->layernorm_output));
      }
      // Each context holds its own request's rows: its backward is the sequence's.
      const at::Tensor g = RandN({inputs[size_t(i)].req.input.shape[0], 24});
      auto ga = core::TensorBackward(batched, together[size_t(i)]->context_id, g, false, false);
      auto gb = core::TensorBackward(sequential, alone->context_id, g, false, false);
      ASSERT_TRUE(ga.ok() && gb.ok()) << ga.status() << gb.status();
      EXPECT_TRUE(at::equal(*ga, *gb)) << "grad_input of request " << i;
    }
    EXPECT_EQ(batched.Stats().live_contexts, 0);
    const auto sa = batched.Scaling(a->module_id), sb = sequential.Scaling(b->module_id);
    ASSERT_TRUE(sa.ok() && sb.ok());
    for (size_t r = 0; r < sa->size(); ++r) {
      EXPECT_EQ((*sa)[r].scale, (*sb)[r].scale) << (*sa)[r].role;
      EXPECT_EQ((*sa)[r].history, (*sb)[r].history) << (*sa)[r].role;
    }
    const auto wa = core::TensorGradients(batched, a->module_id, false);
    const auto wb = core::TensorGradients(sequential, b->module_id, false);
    ASSERT_TRUE(wa.ok() && wb.ok());
    for (size_t p = 0; p < wa->tensors.size(); ++p) {
      EXPECT_TRUE(at::equal(wa->tensors[p].second, wb->tensors[p].second)) << wa->tensors[p].first;
    }
    ++cases;
  }
  EXPECT_EQ(cases, 3 * 3 * 4 * 3);
}

TEST_F(ForwardBatchTest, AMalformedOrNonFiniteRequestFailsAloneAndTheOthersGoOn) {
  core::ModuleHost host(core::ContextLimits{}, nullptr, BackendFor("cpu-ordered"));
  auto info = host.Create(MakeModuleSpec(ModuleKind::kLayerNormMlp, 32, 16, 48, 7));
  ASSERT_TRUE(info.ok());
  const std::string id = info->module_id;
  std::vector<WireInput> inputs;
  inputs.push_back(Encode(RandN({3, 32}), DType::kF32, DType::kF32));
  inputs.push_back(Encode(RandN({2, 31}), DType::kF32, DType::kF32));  // wrong width
  at::Tensor bad = RandN({4, 32});
  bad[2][5] = std::numeric_limits<float>::infinity();
  inputs.push_back(Encode(bad, DType::kF32, DType::kF32));
  // F32 like the others: a request of another input dtype would make the batch run everything
  // alone before the non-finite one could fail inside it.
  inputs.push_back(Encode(RandN({1, 32}), DType::kF32, DType::kF32));
  std::vector<const core::WireForwardRequest*> reqs;
  for (const WireInput& w : inputs) reqs.push_back(&w.req);
  const core::HostStats before = host.Stats();
  const auto batched = host.ForwardBatch(id, reqs);
  ASSERT_EQ(batched.size(), 4u);
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto alone = host.Forward(id, inputs[i].req);
    ASSERT_EQ(batched[i].ok(), alone.ok()) << "request " << i;
    if (alone.ok()) {
      EXPECT_TRUE(SameEncoding(batched[i]->output, alone->output)) << "request " << i;
    } else {
      EXPECT_EQ(batched[i].status(), alone.status()) << "request " << i;
    }
  }
  EXPECT_EQ(batched[1].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(batched[2].ok());
  EXPECT_TRUE(batched[0].ok());
  EXPECT_TRUE(batched[3].ok());
  // Nothing was kept and no scaling state moved.
  EXPECT_EQ(host.Stats().live_contexts, before.live_contexts);
}

TEST_F(ForwardBatchTest, AnUnknownModuleFailsEveryRequest) {
  core::ModuleHost host(core::ContextLimits{}, nullptr, BackendFor("cpu-ordered"));
  WireInput w = Encode(RandN({2, 8}), DType::kF32, DType::kF32);
  const auto batched = host.ForwardBatch("00000000000000000000000000000000", {&w.req, &w.req});
  ASSERT_EQ(batched.size(), 2u);
  for (const auto& r : batched) EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ForwardBatchTest, TheScalingStateDoesNotMove) {
  core::ModuleHost host(core::ContextLimits{}, nullptr, BackendFor("cpu-ordered"));
  core::ModuleSpec spec = MakeLinearSpec(16, 8, 3);
  spec.recipe = DelayedRecipe(device::AmaxAlgo::kMostRecent, 8);
  auto info = host.Create(spec);
  ASSERT_TRUE(info.ok());
  auto f = core::TensorForward(host, info->module_id, RandN({4, 16}), true);
  ASSERT_TRUE(f.ok());
  const auto before = host.Scaling(info->module_id);
  ASSERT_TRUE(before.ok());
  WireInput a = Encode(RandN({3, 16}, 10.0), DType::kF32, DType::kF32);
  WireInput b = Encode(RandN({5, 16}, 0.1), DType::kF32, DType::kF32);
  for (const auto& r : host.ForwardBatch(info->module_id, {&a.req, &b.req})) ASSERT_TRUE(r.ok());
  const auto after = host.Scaling(info->module_id);
  ASSERT_TRUE(after.ok());
  ASSERT_EQ(before->size(), after->size());
  for (size_t i = 0; i < before->size(); ++i) {
    EXPECT_EQ((*before)[i].scale, (*after)[i].scale) << (*before)[i].role;
    EXPECT_EQ((*before)[i].history, (*after)[i].history) << (*before)[i].role;
  }
}

// ModuleHost::BackwardBatch: two identical modules with the same contexts (each made by a
// training forward alone); one runs the backwards as a batch, the other one after another. Every
// grad_input, the scaling state and the accumulated gradients must match bit for bit.
class BackwardBatchTest : public ForwardBatchTest {
 protected:
  struct Pair {
    core::ModuleHost batched, sequential;
    std::string a, b;  // the module on each
    Pair(const core::ModuleSpec& spec, const std::string& backend)
        : batched(core::ContextLimits{}, nullptr, BackendFor(backend)),
          sequential(core::ContextLimits{}, nullptr, BackendFor(backend)) {
      auto x = batched.Create(spec);
      auto y = sequential.Create(spec);
      EXPECT_TRUE(x.ok() && y.ok());
      if (x.ok()) a = x->module_id;
      if (y.ok()) b = y->module_id;
    }
  };
  // One backward request: its gradients' bytes and the views BackwardBatch reads.
  struct Grad {
    WireInput out, ln;
    core::WireBackwardRequest req;
  };
  static Grad MakeGrad(const at::Tensor& g, const at::Tensor& g_ln, DType dtype,
                       DType grad_input_dtype, bool skip) {
    Grad w;
    w.out = Encode(g, dtype, DType::kF32);
    w.req.grad_output = w.out.req.input;
    if (g_ln.defined()) {
      w.ln = Encode(g_ln, dtype, DType::kF32);
      w.req.grad_layernorm_output = w.ln.req.input;
    }
    w.req.grad_input_dtype = grad_input_dtype;
    w.req.skip_grad_input = skip;
    return w;
  }
  // The same training forward on both hosts: the two contexts.
  static std::pair<std::string, std::string> Contexts(Pair& p, const at::Tensor& x) {
    auto fa = core::TensorForward(p.batched, p.a, x, true);
    auto fb = core::TensorForward(p.sequential, p.b, x, true);
    EXPECT_TRUE(fa.ok() && fb.ok());
    return {fa.ok() ? fa->context_id : "", fb.ok() ? fb->context_id : ""};
  }
  static void ExpectSameState(Pair& p) {
    const auto sa = p.batched.Scaling(p.a), sb = p.sequential.Scaling(p.b);
    ASSERT_TRUE(sa.ok() && sb.ok());
    for (size_t r = 0; r < sa->size(); ++r) {
      EXPECT_EQ((*sa)[r].scale, (*sb)[r].scale) << (*sa)[r].role;
      EXPECT_EQ((*sa)[r].history, (*sb)[r].history) << (*sa)[r].role;
    }
    const auto wa = core::TensorGradients(p.batched, p.a, false);
    const auto wb = core::TensorGradients(p.sequential, p.b, false);
    ASSERT_TRUE(wa.ok() && wb.ok());
    ASSERT_EQ(wa->tensors.size(), wb->tensors.size());
    for (size_t i = 0; i < wa->tensors.size(); ++i) {
      EXPECT_TRUE(at::equal(wa->tensors[i].second, wb->tensors[i].second)) << wa->tensors[i].first;
    }
    EXPECT_EQ(p.batched.Stats().live_contexts, p.sequential.Stats().live_contexts);
  }
};

// How often a batch of backwards waits for the device, on the host model of a GPU's reads
// (queued_reads_backend.h): once per request, for its grad_input's copy back (the first of them
// brings every request's check and every cast's amax, queued before it), never for a check; a
// batch that returns no grad_input (skip_grad_input) waits once, for its verdicts.
TEST_F(BackwardBatchTest, ABatchWaitsOnlyForItsResultsCopies) {
  const auto b = std::make_shared<QueuedReadsBackend>();
  core::ModuleHost host(core::ContextLimits{}, nullptr, b);
  for (ModuleKind kind :
       {ModuleKind::kLinear, ModuleKind::kLayerNormLinear, ModuleKind::kLayerNormMlp}) {
    SCOPED_TRACE(core::ModuleKindName(kind));
    auto info = host.Create(MakeModuleSpec(kind, 40, 24, 56, 7));
    ASSERT_TRUE(info.ok()) << info.status();
    const int n = 3;
    for (bool skip : {false, true}) {
      SCOPED_TRACE(skip ? "skip_grad_input" : "with grad_input");
      std::vector<std::string> ids;
      std::vector<Grad> grads;
      for (int i = 0; i < n; ++i) {
        auto fwd = core::TensorForward(host, info->module_id, RandN({5 + i, 40}), true);
        ASSERT_TRUE(fwd.ok()) << fwd.status();
        ids.push_back(fwd->context_id);
        grads.push_back(MakeGrad(RandN({5 + i, 24}), at::Tensor(), DType::kF32, DType::kF32, skip));
      }
      std::vector<const core::WireBackwardRequest*> reqs;
      for (const Grad& g : grads) reqs.push_back(&g.req);
      const int64_t before = b->HostWaits();
      core::ModuleHost::BatchRan ran;
      const auto together = host.BackwardBatch(ids, reqs, &ran);
      ASSERT_EQ(ran.requests, n);
      for (const auto& r : together) ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(b->HostWaits() - before, skip ? 1 : n);
    }
  }
}

// n F32 forwards of (rows + i) x in values, and the requests ForwardBatch takes (pointing into
// `inputs`: not copied).
struct ForwardRequests {
  ForwardRequests(int n, int64_t rows, int64_t in, bool training) {
    for (int i = 0; i < n; ++i) {
      inputs.push_back(Encode(RandN({rows + i, in}), DType::kF32, DType::kF32));
      inputs.back().req.training = training;
    }
    for (const WireInput& w : inputs) reqs.push_back(&w.req);
  }
  ForwardRequests(const ForwardRequests&) = delete;
  ForwardRequests& operator=(const ForwardRequests&) = delete;
  std::vector<WireInput> inputs;
  std::vector<const core::WireForwardRequest*> reqs;
};

// The same for a batch of forwards, training and inference: one wait per result tensor, for its
// copy back (the first brings every amax read after it): one per request, two when the module
// returns its LayerNorm output.
TEST(ForwardBatchWaits, ABatchWaitsOnlyForItsResultsCopies) {
  const auto b = std::make_shared<QueuedReadsBackend>();
  core::ModuleHost host(core::ContextLimits{}, nullptr, b);
  const int n = 3;
  auto expect_waits = [&](const core::ModuleSpec& spec, bool training, int per_request) {
    auto info = host.Create(spec);
    ASSERT_TRUE(info.ok()) << info.status();
    const ForwardRequests f(n, 5, spec.in_features, training);
    const int64_t before = b->HostWaits();
    const auto together = host.ForwardBatch(info->module_id, f.reqs);
    for (const auto& r : together) {
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->batch_requests, n);
      EXPECT_EQ(r->has_layernorm_output, spec.return_layernorm_output);
    }
    EXPECT_EQ(b->HostWaits() - before, per_request * n);
  };
  for (ModuleKind kind :
       {ModuleKind::kLinear, ModuleKind::kLayerNormLinear, ModuleKind::kLayerNormMlp}) {
    for (bool training : {false, true}) {
      SCOPED_TRACE(std::string(core::ModuleKindName(kind)) + (training ? " training" : ""));
      expect_waits(MakeModuleSpec(kind, 40, 24, 56, 7), training, 1);
    }
  }
  SCOPED_TRACE("LayerNormLinear returning its LayerNorm output");
  core::ModuleSpec spec = MakeModuleSpec(ModuleKind::kLayerNormLinear, 40, 24, 0, 8);
  spec.return_layernorm_output = true;
  expect_waits(spec, false, 2);
}

// The reference backend whose ToWire throws once, on demand, as a device error would.
class ToWireFailsOnce final : public device::ReferenceBackend {
 public:
  wire::EncodedTensor ToWire(const at::Tensor& x, DType dtype,
                             std::vector<int64_t> shape) const override {
    if (armed) {
      armed = false;
      throw std::runtime_error("the device went away");
    }
    return device::ReferenceBackend::ToWire(x, dtype, std::move(shape));
  }
  mutable bool armed = false;
};

// A batch encodes its results before anything changes: when that fails, each request runs alone
// (and here succeeds, the failure having passed), with the state a sequence of them leaves: a
// context per training forward, every backward's gradients once.
TEST_F(BackwardBatchTest, ABatchWhoseEncodingFailsRunsItsRequestsAlone) {
  const auto b = std::make_shared<ToWireFailsOnce>();
  core::ModuleHost host(core::ContextLimits{}, nullptr, b);
  auto info = host.Create(MakeModuleSpec(ModuleKind::kLinear, 40, 24, 0, 7));
  ASSERT_TRUE(info.ok()) << info.status();
  const int n = 3;
  const ForwardRequests f(n, 2, 40, /*training=*/true);
  b->armed = true;
  const auto forwards = host.ForwardBatch(info->module_id, f.reqs);
  EXPECT_FALSE(b->armed);
  std::vector<std::string> ids;
  for (const auto& r : forwards) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->batch_requests, 0) << "ran alone";
    ids.push_back(r->context_id);
  }
  EXPECT_EQ(host.Stats().live_contexts, n);
  std::vector<Grad> grads;
  for (int i = 0; i < n; ++i) {
    grads.push_back(MakeGrad(RandN({2 + i, 24}), at::Tensor(), DType::kF32, DType::kF32, false));
  }
  std::vector<const core::WireBackwardRequest*> breqs;
  for (const Grad& g : grads) breqs.push_back(&g.req);
  b->armed = true;
  core::ModuleHost::BatchRan ran;
  const auto backwards = host.BackwardBatch(ids, breqs, &ran);
  EXPECT_FALSE(b->armed);
  EXPECT_EQ(ran.requests, 0) << "ran alone";
  for (const auto& r : backwards) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->has_value());
  }
  EXPECT_EQ(host.Stats().live_contexts, 0);
  const auto g = core::TensorGradients(host, info->module_id, false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->accumulated_backwards, n);
}

TEST_F(BackwardBatchTest, BackwardBatchesAreTheSequenceOfTheirRequests) {
  const auto dtypes = {DType::kF32, DType::kBF16};
  std::uniform_int_distribution<int> requests(2, 16), rows(1, 300);
  int cases = 0;
  for (const Case& c : Cases(dtypes)) {
    SCOPED_TRACE(Name(c));
    core::ModuleSpec spec = SpecFor(c, uint64_t(cases));
    // A checkpointed LayerNorm kind recomputes its forward: those batches run one by one.
    spec.checkpoint = c.kind != ModuleKind::kLinear && cases % 4 == 3;
    Pair p(spec, c.backend);
    const bool skip = cases % 5 == 4;
    // Two rounds, so that under delayed scaling the second starts from moved scales.
    for (int round = 0; round < 2; ++round) {
      const int n = requests(Rng());
      std::vector<std::string> ids_a, ids_b;
      std::vector<Grad> grads;
      for (int i = 0; i < n; ++i) {
        const int64_t m = rows(Rng());
        auto [ca, cb] = Contexts(p, RandN({m, 40}, std::pow(2.0, double(i % 3))));
        ids_a.push_back(ca);
        ids_b.push_back(cb);
        // Mixed magnitudes: each request's own amax sets its gradient casts' scales.
        const double scale = std::pow(4.0, double((i + cases) % 5) - 2.0);
        at::Tensor g_ln;
        if (spec.return_layernorm_output) g_ln = RandN({m, 40}, scale);
        grads.push_back(MakeGrad(RandN({m, 24}, scale), g_ln, c.dtype,
                                 i % 2 ? DType::kBF16 : DType::kF32, skip));
      }
      std::vector<const core::WireBackwardRequest*> reqs;
      for (const Grad& g : grads) reqs.push_back(&g.req);
      const int64_t before = p.batched.Stats().batched_backwards;
      const auto together = p.batched.BackwardBatch(ids_a, reqs);
      ASSERT_EQ(together.size(), size_t(n));
      EXPECT_EQ(p.batched.Stats().batched_backwards - before, spec.checkpoint ? 0 : n);
      for (int i = 0; i < n; ++i) {
        auto alone = p.sequential.Backward(ids_b[size_t(i)], grads[size_t(i)].req);
        ASSERT_TRUE(alone.ok()) << alone.status();
        ASSERT_TRUE(together[size_t(i)].ok()) << together[size_t(i)].status();
        ASSERT_EQ(together[size_t(i)]->has_value(), alone->has_value());
        EXPECT_EQ(alone->has_value(), !skip);
        if (alone->has_value()) {
          EXPECT_TRUE(SameEncoding(**together[size_t(i)], **alone))
              << "grad_input of request " << i << " of " << n;
        }
      }
      ExpectSameState(p);
      EXPECT_EQ(p.batched.Stats().live_contexts, 0);
    }
    ++cases;
  }
  EXPECT_EQ(cases, 3 * 3 * 4 * 2);
}

TEST_F(BackwardBatchTest, ABadOrNonFiniteRequestGetsItsOwnAnswerAndTheOthersAreTheSequence) {
  for (bool delayed : {false, true}) {
    SCOPED_TRACE(delayed ? "delayed" : "current");
    core::ModuleSpec spec = MakeModuleSpec(ModuleKind::kLayerNormMlp, 40, 24, 56, 9);
    if (delayed) spec.recipe = DelayedRecipe(device::AmaxAlgo::kMax, 4);
    Pair p(spec, "cpu-ordered");
    std::vector<std::string> ids_a, ids_b;
    std::vector<Grad> grads;
    for (int i = 0; i < 7; ++i) {
      auto [ca, cb] = Contexts(p, RandN({3 + i, 40}));
      ids_a.push_back(ca);
      ids_b.push_back(cb);
      at::Tensor g = RandN({3 + i, 24});
      if (i == 4) g[1][2] = std::numeric_limits<float>::quiet_NaN();  // refused, context kept
      if (i == 2) g = RandN({3 + i, 23});                             // the wrong width
      grads.push_back(MakeGrad(g, at::Tensor(), DType::kF32, DType::kF32, false));
    }
    ids_a[5] = ids_b[5] = "0123456789abcdef0123456789abcdef";  // unknown
    std::vector<const core::WireBackwardRequest*> reqs;
    for (const Grad& g : grads) reqs.push_back(&g.req);
    const auto together = p.batched.BackwardBatch(ids_a, reqs);
    ASSERT_EQ(together.size(), 7u);
    for (size_t i = 0; i < 7; ++i) {
      auto alone = p.sequential.Backward(ids_b[i], grads[i].req);
      ASSERT_EQ(together[i].ok(), alone.ok()) << "request " << i << ": " << together[i].status();
      if (!alone.ok()) {
        EXPECT_EQ(together[i].status().code(), alone.status().code()) << "request " << i;
        continue;
      }
      EXPECT_TRUE(SameEncoding(**together[i], **alone)) << "request " << i;
    }
    EXPECT_EQ(together[2].status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_FALSE(together[4].ok());
    EXPECT_EQ(together[5].status().code(), absl::StatusCode::kNotFound);
    // Requests 0, 1 and 3 ran together; 4 was refused, so 6 ran alone after it.
    EXPECT_EQ(p.batched.Stats().batched_backwards, 3);
    // The refused one's, the bad shape's, and the one request 5 did not name.
    EXPECT_EQ(p.batched.Stats().live_contexts, 3);
    ExpectSameState(p);
  }
}

TEST_F(BackwardBatchTest, MixedRequestsKeepTheSequencesOrder) {
  // Under delayed scaling every backward is a step: whatever cannot join the batch must not run
  // out of its turn. A request with another skip_grad_input ends the batch; it and the later
  // ones run alone, in order, and everything is still the sequence's bits.
  for (const char* backend : {"reference", "cpu-ordered"}) {
    SCOPED_TRACE(backend);
    core::ModuleSpec spec = MakeModuleSpec(ModuleKind::kLayerNormLinear, 40, 24, 56, 5);
    spec.recipe = DelayedRecipe(device::AmaxAlgo::kMostRecent, 2);
    Pair p(spec, backend);
    std::vector<std::string> ids_a, ids_b;
    std::vector<Grad> grads;
    const bool skips[] = {false, false, false, true, false, true, false};
    for (int i = 0; i < 7; ++i) {
      auto [ca, cb] = Contexts(p, RandN({2 + i, 40}));
      ids_a.push_back(ca);
      ids_b.push_back(cb);
      grads.push_back(MakeGrad(RandN({2 + i, 24}, std::pow(4.0, double(i % 3) - 1.0)), at::Tensor(),
                               DType::kF32, DType::kF32, skips[i]));
    }
    ids_a[1] = ids_b[1] = "0123456789abcdef0123456789abcdef";  // unknown: changes nothing
    std::vector<const core::WireBackwardRequest*> reqs;
    for (const Grad& g : grads) reqs.push_back(&g.req);
    const auto together = p.batched.BackwardBatch(ids_a, reqs);
    ASSERT_EQ(together.size(), 7u);
    for (size_t i = 0; i < 7; ++i) {
      auto alone = p.sequential.Backward(ids_b[i], grads[i].req);
      ASSERT_EQ(together[i].ok(), alone.ok()) << "request " << i;
      if (!alone.ok()) continue;
      ASSERT_EQ(together[i]->has_value(), alone->has_value());
      if (alone->has_value()) {
        EXPECT_TRUE(SameEncoding(**together[i], **alone)) << i;
      }
    }
    EXPECT_EQ(together[1].status().code(), absl::StatusCode::kNotFound);
    // Requests 0 and 2 ran as the batch (1 was skipped over); 3 ended it.
    EXPECT_EQ(p.batched.Stats().batched_backwards, 2);
    ExpectSameState(p);
  }
}

TEST_F(BackwardBatchTest, AContextOfAnotherModuleNeverRunsOnThisOne) {
  // Module one's context with the wrong shape comes first, then module two's contexts (same
  // widths): they run on module two, and module one's gradients stay zero.
  core::ModuleHost host(core::ContextLimits{}, nullptr, BackendFor("cpu-ordered"));
  auto one = host.Create(MakeLinearSpec(16, 8, 1));
  auto two = host.Create(MakeLinearSpec(16, 8, 2));
  ASSERT_TRUE(one.ok() && two.ok());
  auto f1 = core::TensorForward(host, one->module_id, RandN({3, 16}), true);
  auto f2 = core::TensorForward(host, two->module_id, RandN({2, 16}), true);
  auto f3 = core::TensorForward(host, two->module_id, RandN({4, 16}), true);
  ASSERT_TRUE(f1.ok() && f2.ok() && f3.ok());
  std::vector<Grad> grads;
  grads.push_back(MakeGrad(RandN({5, 8}), at::Tensor(), DType::kF32, DType::kF32, false));
  grads.push_back(MakeGrad(RandN({2, 8}), at::Tensor(), DType::kF32, DType::kF32, false));
  grads.push_back(MakeGrad(RandN({4, 8}), at::Tensor(), DType::kF32, DType::kF32, false));
  const auto r = host.BackwardBatch({f1->context_id, f2->context_id, f3->context_id},
                                    {&grads[0].req, &grads[1].req, &grads[2].req});
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].status().code(), absl::StatusCode::kInvalidArgument) << r[0].status();
  EXPECT_TRUE(r[1].ok() && r[2].ok());
  EXPECT_EQ(host.Stats().batched_backwards, 2);
  const auto g1 = core::TensorGradients(host, one->module_id, false);
  const auto g2 = core::TensorGradients(host, two->module_id, false);
  ASSERT_TRUE(g1.ok() && g2.ok());
  for (const auto& [name, t] : g1->tensors) EXPECT_EQ(t.abs().max().item<float>(), 0.0f) << name;
  EXPECT_GT(g2->tensors[0].second.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(host.Stats().live_contexts, 1);  // module one's, refused and kept
}

TEST_F(BackwardBatchTest, MismatchedListsAreRefused) {
  core::ModuleHost host(core::ContextLimits{}, nullptr, BackendFor("cpu-ordered"));
  Grad g = MakeGrad(RandN({2, 8}), at::Tensor(), DType::kF32, DType::kF32, false);
  const auto r = host.BackwardBatch({"a", "b"}, {&g.req});
  ASSERT_EQ(r.size(), 2u);
  for (const auto& x : r) EXPECT_EQ(x.status().code(), absl::StatusCode::kInternal);
}

TEST_F(BackwardBatchTest, RetainedContextsStayAndAnotherModulesContextEndsTheBatch) {
  // Module one's two contexts (the first retained), then module two's, then module one's again:
  // the first two run as a batch, module two's context ends it, and the rest run alone in order.
  core::ModuleHost host(core::ContextLimits{}, nullptr, BackendFor("cpu-ordered"));
  auto one = host.Create(MakeLinearSpec(16, 8, 1));
  auto two = host.Create(MakeLinearSpec(16, 8, 2));
  ASSERT_TRUE(one.ok() && two.ok());
  const int64_t rows[] = {3, 4, 2, 5};
  const bool of_one[] = {true, true, false, true};
  std::vector<std::string> ids;
  std::vector<Grad> grads;
  for (int i = 0; i < 4; ++i) {
    auto f = core::TensorForward(host, of_one[i] ? one->module_id : two->module_id,
                                 RandN({rows[i], 16}), true);
    ASSERT_TRUE(f.ok());
    ids.push_back(f->context_id);
    grads.push_back(MakeGrad(RandN({rows[i], 8}), at::Tensor(), DType::kF32, DType::kF32, false));
  }
  grads[0].req.retain = true;
  const auto r =
      host.BackwardBatch(ids, {&grads[0].req, &grads[1].req, &grads[2].req, &grads[3].req});
  ASSERT_EQ(r.size(), 4u);
  for (const auto& x : r) EXPECT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(host.Stats().batched_backwards, 2);
  // The retained one is still there, and its second backward runs.
  EXPECT_EQ(host.Stats().live_contexts, 1);
  EXPECT_TRUE(host.Backward(ids[0], grads[0].req).ok());
  EXPECT_TRUE(host.ReleaseContext(ids[0]).ok());
}

}  // namespace
}  // namespace gradwire::testing
