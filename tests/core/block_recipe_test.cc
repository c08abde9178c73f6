// The block-scaled recipes (BLOCK, MXFP8; docs/block-scaling.md) on the core: each kind's
// forward and backward against float64 (the Linear tightly, against its operands cast block by
// block in the test), one outlier costing only its own rows, the weight workspace cast once per
// weight version, and what is refused (a margin; the CUDA backend).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gradwire/kernels/ref/block_scaling.h"
#include "server/core/contexts/offload.h"
#include "server/core/kinds/layernorm_linear.h"
#include "server/core/kinds/layernorm_mlp.h"
#include "server/core/kinds/linear.h"
#include "server/core/module_host.h"
#include "server/core/tensor_calls.h"
#include "server/device/reference_backend.h"
#include "test_util.h"

namespace gradwire::core {
namespace {

using device::ReferenceBackend;

using gradwire::testing::Act64;
using gradwire::testing::AllClose;
using gradwire::testing::AllCloseToSum;
using gradwire::testing::D;
using gradwire::testing::GemmParams;
using gradwire::testing::GemmSpec;
using gradwire::testing::Into;
using gradwire::testing::MakeBwdArgs;
using gradwire::testing::MakeFwdArgs;
using gradwire::testing::NormwiseClose;
using gradwire::testing::RandN;
using gradwire::testing::RandomLn;
using kernels::Activation;
using kernels::BlockShape;

// The roles' casts as a module makes them (ModuleSteps::Quantizers): E4M3 throughout, or under
// HYBRID the gradient roles in E5M2.
std::vector<QuantizerConfig> BlockScaling(ModuleKind kind, ScalingMode mode, bool hybrid = false) {
  std::vector<QuantizerConfig> q;
  for (const RoleDef& r : FindKind(kind)->Roles()) {
    QuantizerConfig c;
    SetBlockScaling(c, mode, r.weight);
    if (hybrid) c.format = r.format;
    q.push_back(c);
  }
  return q;
}

// The blocks of each operand, as the definitions in docs/block-scaling.md give them (x-shaped:
// the columnwise copies' blocks as they lie on the untransposed tensor).
struct Blocks {
  BlockShape act_row, act_col, w_row, w_col;
};
Blocks BlocksOf(ScalingMode mode) {
  if (mode == ScalingMode::kBlock) return {{1, 128}, {128, 1}, {128, 128}, {128, 128}};
  return {{1, 32}, {32, 1}, {1, 32}, {32, 1}};
}

// t cast to `format` (E4M3 unless said) with `block` and dequantized, as float64.
at::Tensor Deq(const at::Tensor& t, BlockShape block,
               kernels::Fp8Format format = kernels::Fp8Format::kE4M3) {
  const at::Tensor c = t.to(at::kFloat).contiguous();
  const int64_t rows = c.size(0), cols = c.size(1);
  std::vector<uint8_t> codes(size_t(rows * cols));
  std::vector<float> scales(
      size_t(kernels::BlockGridRows(rows, block) * kernels::BlockGridCols(cols, block)));
  kernels::QuantizeBlocks(c.data_ptr<float>(), rows, cols, block, format, codes.data(),
                          scales.data(), nullptr, nullptr);
  at::Tensor out = at::empty({rows, cols}, at::kFloat);
  kernels::DequantizeBlocks(codes.data(), rows, cols, block, scales.data(), format,
                            out.data_ptr<float>());
  return out.to(at::kDouble);
}

// Rows of very different magnitudes (2^-8 .. 2^8): a per-tensor scale would flush the small ones.
at::Tensor MixedRows(int64_t rows, int64_t cols) {
  at::Tensor x = RandN({rows, cols});
  for (int64_t r = 0; r < rows; ++r) x[r].mul_(std::ldexp(1.0, int(r % 5) * 4 - 8));
  return x;
}

// fp32 accumulation of k exact products: within (k + 2) 2^-24 of the sum of |terms|.
double SumTol(int64_t k) { return double(k + 2) * std::ldexp(1.0, -24); }

struct LinearCase {
  ScalingMode mode;
  int64_t m, k, n;
  bool hybrid = false;  // BLOCK's HYBRID: dy in E5M2
};

class BlockLinearTest : public ::testing::TestWithParam<LinearCase> {};

TEST_P(BlockLinearTest, ForwardAndBackwardAreTheGemmsOfTheBlockCastOperands) {
  const LinearCase c = GetParam();
  const Blocks blk = BlocksOf(c.mode);
  const at::Tensor x = MixedRows(c.m, c.k), w = RandN({c.n, c.k}, 1.0 / std::sqrt(double(c.k))),
                   b = RandN({c.n}, 0.5), dy = MixedRows(c.m, c.n);
  ModuleSpec spec = GemmSpec(ModuleKind::kLinear, w, b);
  spec.recipe.mode = c.mode;
  spec.recipe.block_hybrid = c.hybrid;
  const kernels::Fp8Format grad = c.hybrid ? kernels::Fp8Format::kE5M2 : kernels::Fp8Format::kE4M3;
  KindForwardArgs args = MakeFwdArgs(spec, x, GemmParams(w, b), /*training=*/true);
  args.quantizers = BlockScaling(ModuleKind::kLinear, c.mode, c.hybrid);
  auto fwd = LinearForward(args);
  ASSERT_TRUE(fwd.ok()) << fwd.status();

  const at::Tensor xd = Deq(x, blk.act_row), wd = Deq(w, blk.w_row);
  EXPECT_TRUE(AllCloseToSum(fwd->output, xd.mm(wd.t()) + D(b),
                            xd.abs().mm(wd.abs().t()) + D(b).abs(), SumTol(c.k), 1e-30));
  // Against the unquantized product: two E4M3 roundings (2^-4 each) per term.
  EXPECT_TRUE(AllCloseToSum(fwd->output, D(x).mm(D(w).t()) + D(b),
                            D(x).abs().mm(D(w).abs().t()) + D(b).abs(), 0.125, 1e-6));

  const at::Tensor wg = at::zeros({c.n, c.k}), bg = at::zeros({c.n});
  DirectGradients grads = Into(wg, bg);
  KindBackwardArgs bargs = MakeBwdArgs(spec, dy, fwd->saved.get(), &grads);
  bargs.quantizers = BlockScaling(ModuleKind::kLinear, c.mode, c.hybrid);
  auto bwd = LinearBackward(bargs);
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  const at::Tensor dyd = Deq(dy, blk.act_row, grad), wcd = Deq(w, blk.w_col);
  EXPECT_TRUE(
      AllCloseToSum(bwd->grad_input, dyd.mm(wcd), dyd.abs().mm(wcd.abs()), SumTol(c.n), 1e-30));
  const at::Tensor dyc = Deq(dy, blk.act_col, grad), xc = Deq(x, blk.act_col);
  EXPECT_TRUE(AllCloseToSum(wg, dyc.t().mm(xc), dyc.abs().t().mm(xc.abs()), SumTol(c.m), 1e-30));
  // An E4M3 and an E4M3 (2^-4 each) or E5M2 (2^-3) rounding per term.
  EXPECT_TRUE(AllCloseToSum(wg, D(dy).t().mm(D(x)), D(dy).abs().t().mm(D(x).abs()),
                            c.hybrid ? 0.1875 : 0.125, 0));
  // From the unquantized dy, summed in fp32.
  EXPECT_TRUE(AllCloseToSum(bg, D(dy).sum(0), D(dy).abs().sum(0), SumTol(c.m), 1e-30));
}

std::vector<LinearCase> LinearCases() {
  std::vector<LinearCase> out;
  for (ScalingMode mode : {ScalingMode::kBlock, ScalingMode::kMxfp8}) {
    // Size 1, primes, partial blocks along every dimension, more than one block of 128.
    for (const auto& [m, k, n] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {1, 1, 1}, {7, 300, 40}, {130, 200, 136}, {33, 31, 129}}) {
      out.push_back({mode, m, k, n});
      if (mode == ScalingMode::kBlock) out.push_back({mode, m, k, n, /*hybrid=*/true});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, BlockLinearTest, ::testing::ValuesIn(LinearCases()),
                         [](const auto& info) {
                           const LinearCase& c = info.param;
                           return std::string(ScalingModeName(c.mode)) +
                                  (c.hybrid ? "_hybrid_" : "_") + std::to_string(c.m) + "x" +
                                  std::to_string(c.k) + "x" + std::to_string(c.n);
                         });

class BlockLayerNormKindsTest : public ::testing::TestWithParam<ScalingMode> {};

// LayerNormLinear against float64 autograd, with the per-tensor recipes' tolerances.
TEST_P(BlockLayerNormKindsTest, LayerNormLinearMatchesFloat64Autograd) {
  const ScalingMode mode = GetParam();
  const int64_t m = 37, k = 150, n = 40;
  const LayerNormParams ln = RandomLn(k, false);
  const at::Tensor x = RandN({m, k}, 2.0), w = RandN({n, k}, 1.0 / std::sqrt(double(k))),
                   b = RandN({n}, 0.5), dy = RandN({m, n});
  ModuleSpec spec = GemmSpec(ModuleKind::kLayerNormLinear, w, b);
  spec.recipe.mode = mode;
  KindForwardArgs args = MakeFwdArgs(spec, x, GemmParams(w, b, &ln), true);
  args.quantizers = BlockScaling(ModuleKind::kLayerNormLinear, mode);
  auto fwd = LayerNormLinearForward(args);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  const at::Tensor wg = at::zeros({n, k}), bg = at::zeros({n}), gg = at::zeros({k}),
                   beg = at::zeros({k});
  DirectGradients grads = Into(wg, bg, gg, beg);
  KindBackwardArgs bargs = MakeBwdArgs(spec, dy, fwd->saved.get(), &grads);
  bargs.quantizers = BlockScaling(ModuleKind::kLayerNormLinear, mode);
  auto bwd = LayerNormLinearBackward(bargs);
  ASSERT_TRUE(bwd.ok()) << bwd.status();

  at::Tensor x64 = D(x).set_requires_grad(true), g64 = D(ln.gamma).set_requires_grad(true),
             be64 = D(ln.beta).set_requires_grad(true), w64 = D(w).set_requires_grad(true);
  at::Tensor y = at::matmul(at::layer_norm(x64, {k}, g64, be64, 1e-5), w64.t()) + D(b);
  y.backward(D(dy));
  EXPECT_TRUE(NormwiseClose(fwd->output, y.detach(), 0.125));
  EXPECT_TRUE(NormwiseClose(bwd->grad_input, x64.grad(), 0.25));
  EXPECT_TRUE(NormwiseClose(wg, w64.grad(), 0.25));
  EXPECT_TRUE(NormwiseClose(gg, g64.grad(), 0.25));
  EXPECT_TRUE(NormwiseClose(beg, be64.grad(), 0.25));
  EXPECT_TRUE(AllClose(bg, D(dy).sum(0), 1e-5, 1e-5));
}

// LayerNormMLP (every activation, with and without recompute) against float64 autograd.
TEST_P(BlockLayerNormKindsTest, LayerNormMlpMatchesFloat64Autograd) {
  const ScalingMode mode = GetParam();
  const int64_t m = 35, k = 140, f = 72, n = 33;
  for (Activation act :
       {Activation::kGelu, Activation::kRelu, Activation::kSwiglu, Activation::kGeglu}) {
    for (bool checkpoint : {false, true}) {
      SCOPED_TRACE(std::string(kernels::ActivationName(act)) + (checkpoint ? " checkpoint" : ""));
      const int64_t f1 = kernels::IsGated(act) ? 2 * f : f;
      const LayerNormParams ln = RandomLn(k, false);
      const at::Tensor x = RandN({m, k}, 2.0), w1 = RandN({f1, k}, 1.0 / std::sqrt(double(k))),
                       w2 = RandN({n, f}, 1.0 / std::sqrt(double(f))), b1 = RandN({f1}, 0.5),
                       b2 = RandN({n}, 0.5), dy = RandN({m, n});
      ModuleSpec spec;
      spec.kind = ModuleKind::kLayerNormMlp;
      spec.in_features = k;
      spec.out_features = n;
      spec.ffn_features = f;
      spec.bias = true;
      spec.activation = act;
      spec.checkpoint = checkpoint;
      spec.recipe.mode = mode;
      ParamTable p;
      p[Param::kLayerNormWeight] = ln.gamma;
      p[Param::kLayerNormBias] = ln.beta;
      p[Param::kFc1Weight] = w1;
      p[Param::kFc1Bias] = b1;
      p[Param::kFc2Weight] = w2;
      p[Param::kFc2Bias] = b2;
      KindForwardArgs args = MakeFwdArgs(spec, x, std::move(p), true);
      args.quantizers = BlockScaling(ModuleKind::kLayerNormMlp, mode);
      auto fwd = LayerNormMlpForward(args);
      ASSERT_TRUE(fwd.ok()) << fwd.status();
      ParamTable t;
      const at::Tensor gg = t[Param::kLayerNormWeight] = at::zeros({k});
      const at::Tensor beg = t[Param::kLayerNormBias] = at::zeros({k});
      const at::Tensor gw1 = t[Param::kFc1Weight] = at::zeros({f1, k});
      const at::Tensor gb1 = t[Param::kFc1Bias] = at::zeros({f1});
      const at::Tensor gw2 = t[Param::kFc2Weight] = at::zeros({n, f});
      const at::Tensor gb2 = t[Param::kFc2Bias] = at::zeros({n});
      DirectGradients grads(*MakeReferenceBackend(), t);
      KindBackwardArgs bargs = MakeBwdArgs(spec, dy, fwd->saved.get(), &grads);
      bargs.quantizers = BlockScaling(ModuleKind::kLayerNormMlp, mode);
      auto bwd = LayerNormMlpBackward(bargs);
      ASSERT_TRUE(bwd.ok()) << bwd.status();

      at::Tensor x64 = D(x).set_requires_grad(true), g64 = D(ln.gamma).set_requires_grad(true),
                 be64 = D(ln.beta).set_requires_grad(true), w164 = D(w1).set_requires_grad(true),
                 w264 = D(w2).set_requires_grad(true), b164 = D(b1).set_requires_grad(true);
      at::Tensor h = at::matmul(at::layer_norm(x64, {k}, g64, be64, 1e-5), w164.t()) + b164;
      at::Tensor y = at::matmul(Act64(act, h, f), w264.t()) + D(b2);
      y.backward(D(dy));
      // ReLU's derivative jumps at 0: an FP8 rounding of FC1's output flips a few of its mask's
      // entries, each a whole-size error upstream of it.
      const double tol = act == Activation::kRelu ? 0.45 : 0.25;
      EXPECT_TRUE(NormwiseClose(fwd->output, y.detach(), 0.125));
      EXPECT_TRUE(NormwiseClose(bwd->grad_input, x64.grad(), tol));
      EXPECT_TRUE(NormwiseClose(gg, g64.grad(), tol));
      EXPECT_TRUE(NormwiseClose(beg, be64.grad(), tol));
      EXPECT_TRUE(NormwiseClose(gw1, w164.grad(), tol));
      EXPECT_TRUE(NormwiseClose(gb1, b164.grad(), tol));
      EXPECT_TRUE(NormwiseClose(gw2, w264.grad(), 0.25));
      EXPECT_TRUE(AllClose(gb2, D(dy).sum(0), 1e-5, 1e-5));
    }
  }
}

// The weights are cast once per weight version: a second forward of the version reuses the
// workspace; its weights carry block scales in both orientations for training (none needed for
// inference, where a training forward then counts as a miss).
TEST_P(BlockLayerNormKindsTest, TheWorkspaceIsCastOncePerWeightVersion) {
  const ScalingMode mode = GetParam();
  const at::Tensor w = RandN({40, 150}, 0.1), b = RandN({40});
  ModuleSpec spec = GemmSpec(ModuleKind::kLinear, w, b);
  spec.recipe.mode = mode;
  for (const BackendPtr& backend : {MakeReferenceBackend(), MakeCpuBackend()}) {
    SCOPED_TRACE(backend->name());
    KindForwardArgs args = MakeFwdArgs(spec, RandN({5, 150}), GemmParams(w, b), false);
    args.backend = backend.get();
    args.quantizers = BlockScaling(ModuleKind::kLinear, mode);
    auto infer = LinearForward(args);
    ASSERT_TRUE(infer.ok()) << infer.status();
    EXPECT_TRUE(infer->workspace_built);
    const Fp8Tensor& wi = infer->workspace->weights[0];
    EXPECT_TRUE(wi.block_scaled);
    EXPECT_TRUE(wi.has_rowwise());
    EXPECT_FALSE(wi.has_columnwise());
    args.workspace = infer->workspace;
    auto again = LinearForward(args);
    ASSERT_TRUE(again.ok());
    EXPECT_FALSE(again->workspace_built);
    EXPECT_EQ(again->workspace, infer->workspace);
    EXPECT_TRUE(at::equal(again->output, infer->output));
    args.training = true;
    auto train = LinearForward(args);
    ASSERT_TRUE(train.ok());
    EXPECT_TRUE(train->workspace_built);  // inference built no columnwise copy
    const Fp8Tensor& wt = train->workspace->weights[0];
    ASSERT_TRUE(wt.has_columnwise() && wt.columnwise_scale_inv.defined());
    const Blocks blk = BlocksOf(mode);
    EXPECT_EQ(wt.rowwise_scale_inv.size(0), kernels::BlockGridRows(40, blk.w_row));
    EXPECT_EQ(wt.rowwise_scale_inv.size(1), kernels::BlockGridCols(150, blk.w_row));
    EXPECT_EQ(wt.columnwise_scale_inv.size(0), kernels::BlockGridCols(150, blk.w_col));
    EXPECT_EQ(wt.columnwise_scale_inv.size(1), kernels::BlockGridRows(40, blk.w_col));
    EXPECT_EQ(bool(wt.fprop_value_panels), std::string(backend->name()) == "cpu");
    EXPECT_EQ(bool(wt.dgrad_value_panels), std::string(backend->name()) == "cpu");
    EXPECT_TRUE(at::equal(train->output, infer->output));  // training changes no forward bit
    args.workspace = train->workspace;
    auto train2 = LinearForward(args);
    ASSERT_TRUE(train2.ok());
    EXPECT_FALSE(train2->workspace_built);
    args.weight_version = 2;  // an update of the weights: a new version, cast again
    auto next = LinearForward(args);
    ASSERT_TRUE(next.ok());
    EXPECT_TRUE(next->workspace_built);
  }
}

// A block-scaled context owns its scales with its codes: ForEachTensor visits every byte bytes()
// counts (what offload moves), and a context packed to host memory and back gives its backward
// the same bits.
TEST_P(BlockLayerNormKindsTest, ASavedContextsScalesTravelWithItsCodes) {
  const ScalingMode mode = GetParam();
  const int64_t m = 19, k = 150, n = 40, f = 64;
  for (ModuleKind kind :
       {ModuleKind::kLinear, ModuleKind::kLayerNormLinear, ModuleKind::kLayerNormMlp}) {
    SCOPED_TRACE(ModuleKindName(kind));
    const LayerNormParams ln = RandomLn(k, false);
    ModuleSpec spec = gradwire::testing::MakeModuleSpec(kind, k, n, f);
    spec.bias = true;
    spec.recipe.mode = mode;
    ParamTable p;
    p[Param::kLayerNormWeight] = ln.gamma;
    p[Param::kLayerNormBias] = ln.beta;
    p[Param::kWeight] = RandN({n, k}, 0.1);
    p[Param::kBias] = RandN({n});
    p[Param::kFc1Weight] = RandN({f, k}, 0.1);
    p[Param::kFc1Bias] = RandN({f});
    p[Param::kFc2Weight] = RandN({n, f}, 0.1);
    p[Param::kFc2Bias] = RandN({n});
    KindForwardArgs args = MakeFwdArgs(spec, MixedRows(m, k), p, true);
    args.quantizers = BlockScaling(kind, mode);
    const ModuleKindOps& ops = *FindKind(kind);
    auto fwd = ops.Forward(args);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    int64_t visited = 0;
    fwd->saved->ForEachTensor([&](at::Tensor& t) {
      if (t.defined()) visited += int64_t(t.nbytes());
    });
    EXPECT_EQ(visited, fwd->saved->bytes());
    const at::Tensor dy = MixedRows(m, n);
    auto backward = [&](const SavedTensors* saved) {
      ParamTable g;
      for (Param param :
           {Param::kWeight, Param::kBias, Param::kLayerNormWeight, Param::kLayerNormBias,
            Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias}) {
        g[param] = at::zeros_like(p[param]);
      }
      DirectGradients grads(*MakeReferenceBackend(), g);
      KindBackwardArgs bargs = MakeBwdArgs(spec, dy, saved, &grads);
      bargs.quantizers = BlockScaling(kind, mode);
      auto r = ops.Backward(bargs);
      EXPECT_TRUE(r.ok()) << r.status();
      return r.ok() ? r->grad_input : at::Tensor();
    };
    const at::Tensor want = backward(fwd->saved.get());
    auto fwd2 = ops.Forward(args);
    ASSERT_TRUE(fwd2.ok());
    auto pack = HostPack::Pack(*fwd2->saved);
    ASSERT_TRUE(pack.ok()) << pack.status();
    EXPECT_EQ((*pack)->bytes(), visited);
    ASSERT_TRUE((*pack)->Unpack(*fwd2->saved).ok());
    EXPECT_TRUE(at::equal(backward(fwd2->saved.get()), want));
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, BlockLayerNormKindsTest,
                         ::testing::Values(ScalingMode::kBlock, ScalingMode::kMxfp8),
                         [](const auto& info) { return std::string(ScalingModeName(info.param)); });

// One element of 3e6 in row 0 of a Linear 256 -> 128, batch 32: under the block recipes the
// other rows come out bit for bit as without it (their blocks never see it), so their error
// against the fp64 product of the unquantized input and weights stays the clean one; under
// per-tensor current scaling the outlier's scale flushes them to the bias.
TEST(BlockRecipeOutlier, OneOutlierCostsOnlyItsOwnRow) {
  for (ScalingMode mode : {ScalingMode::kCurrent, ScalingMode::kBlock, ScalingMode::kMxfp8}) {
    SCOPED_TRACE(ScalingModeName(mode));
    ModuleHost host(ContextLimits{}, nullptr, MakeCpuBackend());
    ModuleSpec spec = gradwire::testing::MakeLinearSpec(256, 128, 11);
    spec.recipe.mode = mode;
    auto info = host.Create(spec);
    ASSERT_TRUE(info.ok()) << info.status();
    auto weights = TensorWeights(host, info->module_id);
    ASSERT_TRUE(weights.ok());
    at::Tensor w, b;
    for (const auto& [name, t] : weights->tensors) (name == "weight" ? w : b) = t;
    const at::Tensor clean = RandN({32, 256});
    at::Tensor dirty = clean.clone();
    dirty[0][17] = 3e6f;
    auto y_clean = TensorForward(host, info->module_id, clean, false);
    auto y_dirty = TensorForward(host, info->module_id, dirty, false);
    ASSERT_TRUE(y_clean.ok() && y_dirty.ok());
    const at::Tensor want = D(clean).mm(D(w).t()) + D(b);
    auto worst = [&](const at::Tensor& y) {
      const at::Tensor rows = want.narrow(0, 1, 31);
      const at::Tensor err = (D(y).narrow(0, 1, 31) - rows).abs().amax(1) / rows.abs().amax(1);
      return err.max().item<double>();
    };
    const double e_clean = worst(y_clean->output), e_dirty = worst(y_dirty->output);
    EXPECT_LT(e_clean, 0.1);
    if (BlockScaled(mode)) {
      EXPECT_LE(e_dirty, 1.5 * e_clean);
      EXPECT_TRUE(at::equal(y_dirty->output.narrow(0, 1, 31), y_clean->output.narrow(0, 1, 31)));
    } else {
      EXPECT_GT(e_dirty, 0.5);  // what the block recipes are for
    }
  }
}

// A module's state (what a checkpoint stores) keeps its recipe: restored, the module is the
// same recipe and computes the same bits.
TEST(BlockRecipeState, ARestoredModuleKeepsItsRecipe) {
  for (auto [mode, hybrid] :
       {std::pair{ScalingMode::kBlock, false}, std::pair{ScalingMode::kBlock, true},
        std::pair{ScalingMode::kMxfp8, false}}) {
    SCOPED_TRACE(std::string(ScalingModeName(mode)) + (hybrid ? " hybrid" : ""));
    ModuleHost host(ContextLimits{}, nullptr, MakeCpuBackend());
    ModuleSpec spec = gradwire::testing::MakeModuleSpec(ModuleKind::kLayerNormMlp, 40, 24, 56, 5);
    spec.recipe.mode = mode;
    spec.recipe.block_hybrid = hybrid;
    auto info = host.Create(spec);
    ASSERT_TRUE(info.ok()) << info.status();
    auto state = host.ExportState(info->module_id);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(state->spec.recipe.mode, mode);
    ModuleHost other(ContextLimits{}, nullptr, MakeCpuBackend());
    ASSERT_TRUE(other.ImportState(*state).ok());
    auto restored = other.Info(state->module_id);
    ASSERT_TRUE(restored.ok()) << restored.status();
    auto again = other.ExportState(state->module_id);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->spec.recipe.mode, mode);
    EXPECT_EQ(again->spec.recipe.block_hybrid, hybrid);
    const at::Tensor x = MixedRows(9, 40);
    auto a = TensorForward(host, info->module_id, x, false);
    auto b = TensorForward(other, state->module_id, x, false);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(at::equal(a->output, b->output));
  }
}

// Block codes that arrived on the wire (FromBlockCodes): the copies as they came, and the amax
// of their decoded values, NaN when a code is NaN.
TEST(BlockRecipeWire, CodesFromTheWireKeepTheirCopiesAndMeasureTheirAmax) {
  const int64_t rows = 37, cols = 300;
  at::Tensor x = MixedRows(rows, cols);
  x[4][7] = 3e6;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  for (int64_t block : {128, 32}) {
    SCOPED_TRACE(block);
    wire::EncodedTensor e = wire::Encode(xf.data_ptr<float>(), {rows, cols}, wire::DType::kFp8E4M3,
                                         {block, /*columnwise=*/true});
    wire::TensorView v;
    v.dtype = e.dtype;
    v.shape = e.shape;
    v.data = e.bytes.data();
    v.blocks = e.blocks;
    v.columnwise = e.columnwise;
    at::Tensor decoded = at::empty({rows, cols}, at::kFloat);
    wire::DecodeView(v, decoded.data_ptr<float>());
    const Fp8Tensor t = device::FromBlockCodes(v, rows, cols, {true, true});
    EXPECT_EQ(t.amax(), decoded.abs().max().item<float>());
    ASSERT_TRUE(t.has_rowwise() && t.has_columnwise());
    EXPECT_EQ(std::memcmp(t.rowwise.data_ptr<uint8_t>(), e.bytes.data(), size_t(rows * cols)), 0);
    EXPECT_EQ(std::memcmp(t.columnwise.data_ptr<uint8_t>(), e.bytes.data() + rows * cols,
                          size_t(rows * cols)),
              0);
    EXPECT_EQ(t.rowwise_block.cols, block);
    EXPECT_EQ(t.columnwise_block.cols, block);
    EXPECT_TRUE(t.rowwise_scale_inv.equal(
        at::from_blob(e.blocks.scale_inv.data(), t.rowwise_scale_inv.sizes(), at::kFloat)));
    EXPECT_TRUE(device::CodesServeInput(v, block == 128 ? ScalingMode::kBlock : ScalingMode::kMxfp8,
                                        /*training=*/true));
    EXPECT_FALSE(device::CodesServeInput(v,
                                         block == 128 ? ScalingMode::kMxfp8 : ScalingMode::kBlock,
                                         /*training=*/false));
    EXPECT_FALSE(device::CodesServeInput(v, ScalingMode::kCurrent, false));
    v.columnwise = {};
    EXPECT_FALSE(device::FromBlockCodes(v, rows, cols, {true, true}).has_columnwise());
    EXPECT_FALSE(device::CodesServeInput(v,
                                         block == 128 ? ScalingMode::kBlock : ScalingMode::kMxfp8,
                                         /*training=*/true));  // training needs both copies
    e.bytes[size_t(20 * cols + 5)] = char(0x7F);               // E4M3's NaN
    EXPECT_TRUE(std::isnan(device::FromBlockCodes(v, rows, cols, {true, false}).amax()));
  }
}

// A backend that says it is the CUDA one (what the refusal reads), computing as the reference.
class NamedCuda final : public ReferenceBackend {
 public:
  const char* name() const override { return "cuda"; }
};

TEST(BlockRecipeRefusals, TheCudaBackendRefusesTheBlockRecipesAtCreation) {
  ModuleHost host(ContextLimits{}, nullptr, std::make_shared<NamedCuda>());
  for (ScalingMode mode : {ScalingMode::kBlock, ScalingMode::kMxfp8}) {
    ModuleSpec spec = gradwire::testing::MakeLinearSpec(16, 8);
    spec.recipe.mode = mode;
    auto info = host.Create(spec);
    ASSERT_FALSE(info.ok());
    EXPECT_EQ(info.status().code(), absl::StatusCode::kFailedPrecondition);
    const std::string msg(info.status().message());
    EXPECT_NE(msg.find(mode == ScalingMode::kBlock ? "BLOCK" : "MXFP8"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--device cuda"), std::string::npos) << msg;
  }
  EXPECT_EQ(host.Stats().modules, 0);
  EXPECT_TRUE(host.Create(gradwire::testing::MakeLinearSpec(16, 8)).ok());  // CURRENT still runs
}

TEST(BlockRecipeRefusals, AMarginIsRefusedUnderTheBlockRecipes) {
  ModuleHost host;
  for (ScalingMode mode : {ScalingMode::kBlock, ScalingMode::kMxfp8}) {
    ModuleSpec spec = gradwire::testing::MakeLinearSpec(16, 8);
    spec.recipe.mode = mode;
    spec.recipe.margin = 2;
    auto info = host.Create(spec);
    ASSERT_FALSE(info.ok());
    EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(info.status().message().find("spec.recipe.margin"), std::string::npos)
        << info.status();
  }
  EXPECT_EQ(host.Stats().modules, 0);
}

}  // namespace
}  // namespace gradwire::core
