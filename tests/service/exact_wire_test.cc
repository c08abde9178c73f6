// The exact wire (client/host_tensor.h: WireForm), the clients' default: a forward's input to a
// module that casts it to E4M3 first under current scaling with margin 0, BLOCK or MXFP8 crosses
// as that cast (under the block recipes with the recipe's row blocks and, in training, the
// columnwise copy), and so does a backward's grad_output to every kind under those recipes (E5M2
// under current scaling, with the columnwise copy under the block recipes), with the bias
// gradient beside it; everything else crosses as F32. Every kind and recipe gives the F32 wire's
// results bit for bit (outputs, input gradients, weight and bias gradients, the weights after
// optimizer steps), and only a Linear under those recipes gets FP8 input. The lossy FP8 wire
// under the block recipes carries block scales both ways.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gradwire/client/client.h"
#include "gradwire/client/kinds.h"
#include "gradwire/client/recipes.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire {
namespace {

using client::HostTensor;
using client::WireDType;
using testing::Random;

// Bit for bit (-0 and +0 told apart).
void ExpectSameBits(const HostTensor& a, const HostTensor& b, const std::string& what) {
  ASSERT_EQ(a.shape, b.shape) << what;
  ASSERT_EQ(a.data.size(), b.data.size()) << what;
  ASSERT_FALSE(a.data.empty()) << what;
  size_t differ = 0;
  for (size_t i = 0; i < a.data.size(); ++i) {
    differ += std::memcmp(&a.data[i], &b.data[i], sizeof(float)) != 0;
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << a.data.size() << " differ";
}

void ExpectSameTensors(const client::NamedTensors& a, const client::NamedTensors& b,
                       const std::string& what) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size()) << what;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].first, b.tensors[i].first);
    ExpectSameBits(a.tensors[i].second, b.tensors[i].second, what + " " + a.tensors[i].first);
  }
}

struct Case {
  const char* name;
  v1::ModuleSpec spec;
  bool fp8_input;  // whether the exact wire sends its input as E4M3
  bool fp8_grad;   // whether it sends grad_output as its FP8 cast
};

v1::ModuleSpec WithRecipe(v1::ModuleSpec spec, v1::ScalingRecipe scaling, int margin = 0) {
  spec.mutable_recipe()->set_scaling(scaling);
  spec.mutable_recipe()->set_margin(margin);
  return spec;
}

// BLOCK with E5M2 gradients.
v1::ModuleSpec BlockHybrid(v1::ModuleSpec spec) {
  spec = WithRecipe(std::move(spec), v1::BLOCK);
  spec.mutable_recipe()->set_format(v1::HYBRID);
  return spec;
}

std::vector<Case> Cases() {
  const v1::ModuleSpec linear = testing::LinearSpec(96, 40, /*bias=*/true, 11);
  const v1::ModuleSpec linear_nobias = testing::LinearSpec(96, 40, /*bias=*/false, 12);
  const v1::ModuleSpec linear_wide = testing::LinearSpec(300, 40, /*bias=*/true, 16);
  const v1::ModuleSpec ln_linear = testing::LayerNormLinearSpec(96, 40, /*bias=*/true, 13);
  v1::ModuleSpec ln_linear_out = ln_linear;
  ln_linear_out.set_return_layernorm_output(true);
  const v1::ModuleSpec mlp = testing::LayerNormMlpSpec(96, 64, v1::GELU, /*bias=*/true, 14);
  const v1::ModuleSpec swiglu = testing::LayerNormMlpSpec(96, 64, v1::SWIGLU, false, 15);
  // A module 300 wide out: gradient rows of two full blocks and a partial one.
  const v1::ModuleSpec linear_wide_out = testing::LinearSpec(40, 300, /*bias=*/true, 17);
  std::vector<Case> cases = {
      {"LinearCurrent", WithRecipe(linear, v1::CURRENT), true, true},
      {"LinearUnspecifiedRecipe", WithRecipe(linear_nobias, v1::SCALING_RECIPE_UNSPECIFIED), true,
       true},
      {"LinearCurrentMargin", WithRecipe(linear, v1::CURRENT, 2), false, false},
      {"LinearDelayed", WithRecipe(linear, v1::DELAYED), false, false},
      {"LinearBlock", WithRecipe(linear, v1::BLOCK), true, true},
      {"LinearBlockHybrid", BlockHybrid(linear), true, true},
      {"LinearMxfp8", WithRecipe(linear_nobias, v1::MXFP8), true, true},
      // Rows of two full blocks and a partial one (128 + 128 + 44; MXFP8 9 x 32 + 12).
      {"LinearBlockWide", WithRecipe(linear_wide, v1::BLOCK), true, true},
      {"LinearMxfp8Wide", WithRecipe(linear_wide, v1::MXFP8), true, true},
      {"LinearBlockWideOut", WithRecipe(linear_wide_out, v1::BLOCK), true, true},
      {"LinearMxfp8WideOut", WithRecipe(linear_wide_out, v1::MXFP8), true, true},
      {"LayerNormMlpBlockHybrid", BlockHybrid(mlp), false, true},
  };
  for (v1::ScalingRecipe r : {v1::CURRENT, v1::DELAYED, v1::BLOCK, v1::MXFP8}) {
    const bool grad = r != v1::DELAYED;
    cases.push_back({"LayerNormLinear", WithRecipe(ln_linear, r), false, grad});
    cases.push_back({"LayerNormLinearWithOutput", WithRecipe(ln_linear_out, r), false, grad});
    cases.push_back({"LayerNormMlp", WithRecipe(mlp, r), false, grad});
    cases.push_back({"LayerNormMlpSwiglu", WithRecipe(swiglu, r), false, grad});
  }
  return cases;
}

class ExactWireTest : public ::testing::TestWithParam<client::ClientOptions::SharedMemory> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.ok());
    client::ClientOptions exact;
    exact.shared_memory = GetParam();
    exact.shared_memory_min_kib = 4;      // these small tensors pass through regions too (auto)
    EXPECT_TRUE(exact.wire_dtype.exact);  // the default
    client::ClientOptions f32 = exact;
    f32.wire_dtype = WireDType::kF32;
    exact_ = server_.Connect(exact);
    f32_ = server_.Connect(f32);
  }

  // Two modules of `spec` (the same seed: the same weights), one driven through each client:
  // training steps with fresh inputs (forward, backward, optimizer step), then an inference
  // forward. Everything that comes back, and the weights at the end, must match bit for bit.
  void RunBoth(const Case& c) {
    SCOPED_TRACE(c.name + std::string(" ") + client::RecipeName(c.spec.recipe().scaling()) +
                 " margin " + std::to_string(c.spec.recipe().margin()));
    EXPECT_EQ(client::ExactWireTakesFp8(c.spec), c.fp8_input);
    // This server sums bias gradients in row order (the CPU backend), as the client does.
    EXPECT_EQ(client::ExactWireGradForm(c.spec, true) != client::ExactGradForm::kNone, c.fp8_grad);
    auto a = exact_->CreateModule(c.spec);
    auto b = f32_->CreateModule(c.spec);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    const std::string ma = a->module_id(), mb = b->module_id();
    const int64_t in = c.spec.in_features(), out = c.spec.out_features();
    const int64_t fp8_before = exact_->exact_fp8_inputs();
    const int64_t grad_before = exact_->exact_fp8_gradients();
    constexpr int kSteps = 3;
    for (int step = 0; step < kSteps; ++step) {
      const int64_t rows = 7 + 9 * step;
      const HostTensor x = Random({rows, in});
      auto fa = exact_->Forward(ma, x, true);
      auto fb = f32_->Forward(mb, x, true);
      ASSERT_TRUE(fa.ok()) << fa.status();
      ASSERT_TRUE(fb.ok()) << fb.status();
      ExpectSameBits(fa->output, fb->output, "output");
      if (c.spec.return_layernorm_output()) {
        ASSERT_TRUE(fa->layernorm_output.has_value() && fb->layernorm_output.has_value());
        ExpectSameBits(*fa->layernorm_output, *fb->layernorm_output, "layernorm_output");
      }
      const HostTensor dy = Random({rows, out});
      client::BackwardOptions bo;
      if (c.spec.return_layernorm_output()) bo.grad_layernorm_output = Random({rows, in});
      auto ga = exact_->Backward(fa->context_id, dy, bo);
      auto gb = f32_->Backward(fb->context_id, dy, bo);
      ASSERT_TRUE(ga.ok()) << ga.status();
      ASSERT_TRUE(gb.ok()) << gb.status();
      ExpectSameBits(*ga, *gb, "grad_input");
      auto da = exact_->GetGradients(ma);
      auto db = f32_->GetGradients(mb);
      ASSERT_TRUE(da.ok() && db.ok());
      ExpectSameTensors(*da, *db, "gradients");
      ASSERT_TRUE(exact_->ApplyGradients(ma).ok());
      ASSERT_TRUE(f32_->ApplyGradients(mb).ok());
    }
    const HostTensor x = Random({5, in});
    auto ia = exact_->Forward(ma, x, false);
    auto ib = f32_->Forward(mb, x, false);
    ASSERT_TRUE(ia.ok() && ib.ok());
    ExpectSameBits(ia->output, ib->output, "inference output");
    auto wa = exact_->GetWeights(ma);
    auto wb = f32_->GetWeights(mb);
    ASSERT_TRUE(wa.ok() && wb.ok());
    ExpectSameTensors(*wa, *wb, "weights");
    // The input crossed as E4M3 on every forward exactly where the rule says.
    EXPECT_EQ(exact_->exact_fp8_inputs() - fp8_before, c.fp8_input ? kSteps + 1 : 0);
    EXPECT_EQ(f32_->exact_fp8_inputs(), 0);
    // And grad_output as its FP8 cast on every backward exactly where the rule says.
    EXPECT_EQ(exact_->exact_fp8_gradients() - grad_before, c.fp8_grad ? kSteps : 0);
    EXPECT_EQ(f32_->exact_fp8_gradients(), 0);
    ASSERT_TRUE(exact_->DeleteModule(ma).ok());
    ASSERT_TRUE(f32_->DeleteModule(mb).ok());
  }

  testing::TestServer server_;
  std::unique_ptr<client::Client> exact_, f32_;
};

TEST_P(ExactWireTest, EveryKindAndRecipeGivesTheF32WiresBits) {
  for (const Case& c : Cases()) RunBoth(c);
  if (GetParam() == client::ClientOptions::SharedMemory::kAuto && !exact_->shared_memory_off()) {
    EXPECT_GT(exact_->shared_memory_calls(), 0);
  }
}

// An input with a NaN or an infinity crosses as F32 (its FP8 cast would hide an infinity): the
// server refuses it as it refuses it from the F32 wire, with the same words.
TEST_P(ExactWireTest, ANonFiniteInputCrossesAsF32AndIsRefusedAlike) {
  const v1::ModuleSpec spec = testing::LinearSpec(32, 16, true, 3);
  const std::string ma = exact_->CreateModule(spec)->module_id();
  const std::string mb = f32_->CreateModule(spec)->module_id();
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    HostTensor x = Random({4, 32});
    x.data[37] = bad;
    EXPECT_EQ(client::ExactInputDType(x, true), WireDType::kF32);
    const int64_t fp8_before = exact_->exact_fp8_inputs();
    auto fa = exact_->Forward(ma, x, true);
    auto fb = f32_->Forward(mb, x, true);
    ASSERT_FALSE(fa.ok());
    ASSERT_FALSE(fb.ok());
    EXPECT_EQ(fa.status().code(), fb.status().code());
    EXPECT_EQ(testing::WithoutRequestId(fa.status().message()),
              testing::WithoutRequestId(fb.status().message()));
    EXPECT_EQ(exact_->exact_fp8_inputs(), fp8_before);
  }
  // A finite one after them goes as E4M3 again.
  const HostTensor x = Random({4, 32});
  EXPECT_EQ(client::ExactInputDType(x, true), WireDType::kFp8E4M3);
  EXPECT_EQ(client::ExactInputDType(x, false), WireDType::kF32);
  auto fa = exact_->Forward(ma, x, false);
  auto fb = f32_->Forward(mb, x, false);
  ASSERT_TRUE(fa.ok() && fb.ok());
  ExpectSameBits(fa->output, fb->output, "output");
}

// A grad_output with a NaN or an infinity, or whose column sums overflow float32, crosses as F32:
// the server answers it as it answers the F32 wire, with the same words, and the context stays
// for a finite gradient after it, which goes as its FP8 cast again.
TEST_P(ExactWireTest, ANonFiniteGradOutputCrossesAsF32AndIsAnsweredAlike) {
  const v1::ModuleSpec spec = WithRecipe(testing::LinearSpec(32, 16, true, 4), v1::BLOCK);
  const std::string ma = exact_->CreateModule(spec)->module_id();
  const std::string mb = f32_->CreateModule(spec)->module_id();
  const HostTensor x = Random({4, 32});
  auto fa = exact_->Forward(ma, x, true);
  auto fb = f32_->Forward(mb, x, true);
  ASSERT_TRUE(fa.ok() && fb.ok());
  client::BackwardOptions keep;
  keep.retain = true;
  HostTensor overflow = Random({4, 16});
  overflow.data[3] = overflow.data[16 + 3] = 3e38f;  // finite; column 3 sums to inf
  for (float bad :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 0.0f}) {
    HostTensor dy = overflow;
    if (bad != 0.0f) {
      dy = Random({4, 16});
      dy.data[21] = bad;
    }
    const client::TensorForm form = client::GradOutputForm(
        client::kExactWire, dy, client::ExactGradForm::kE4M3, /*column_sums=*/true, 128);
    EXPECT_EQ(form.dtype, WireDType::kF32);
    EXPECT_TRUE(form.column_sums.empty());
    const int64_t before = exact_->exact_fp8_gradients();
    auto ga = exact_->Backward(fa->context_id, dy, keep);
    auto gb = f32_->Backward(fb->context_id, dy, keep);
    ASSERT_FALSE(ga.ok());
    ASSERT_FALSE(gb.ok());
    EXPECT_EQ(ga.status().code(), gb.status().code());
    // The same words, each naming its own context.
    auto words = [](const absl::Status& s, const std::string& context) {
      std::string m = testing::WithoutRequestId(s.message());
      if (const size_t at = m.find(context); at != std::string::npos) {
        m.replace(at, context.size(), "CONTEXT");
      }
      return m;
    };
    EXPECT_EQ(words(ga.status(), fa->context_id), words(gb.status(), fb->context_id));
    EXPECT_EQ(exact_->exact_fp8_gradients(), before);
  }
  const HostTensor dy = Random({4, 16});
  auto ga = exact_->Backward(fa->context_id, dy);
  auto gb = f32_->Backward(fb->context_id, dy);
  ASSERT_TRUE(ga.ok() && gb.ok()) << ga.status() << gb.status();
  ExpectSameBits(*ga, *gb, "grad_input");
  ExpectSameTensors(*exact_->GetGradients(ma), *f32_->GetGradients(mb), "gradients");
  EXPECT_EQ(exact_->exact_fp8_gradients(), 1);
}

// The Train stream takes the same form: a module the client created sends its input as E4M3 there
// too, with the F32 stream's results.
TEST_P(ExactWireTest, TheTrainStreamGivesTheF32WiresBits) {
  const v1::ModuleSpec spec = testing::LinearSpec(64, 24, true, 9);
  const std::string ma = exact_->CreateModule(spec)->module_id();
  const std::string mb = f32_->CreateModule(spec)->module_id();
  auto sa = exact_->OpenTrainStream();
  auto sb = f32_->OpenTrainStream();
  const HostTensor x = Random({12, 64}), dy = Random({12, 24});
  ASSERT_TRUE(sa->SendForward(1, ma, x, true));
  ASSERT_TRUE(sb->SendForward(1, mb, x, true));
  auto ra = sa->Read();
  auto rb = sb->Read();
  ASSERT_TRUE(ra && rb);
  ASSERT_EQ(ra->code(), 0) << ra->message();
  ASSERT_EQ(rb->code(), 0) << rb->message();
  ExpectSameBits(*client::FromWire(ra->forward().output()),
                 *client::FromWire(rb->forward().output()), "output");
  ASSERT_TRUE(sa->SendBackward(2, ra->forward().context_id(), dy));
  ASSERT_TRUE(sb->SendBackward(2, rb->forward().context_id(), dy));
  ra = sa->Read();
  rb = sb->Read();
  ASSERT_TRUE(ra && rb);
  ASSERT_EQ(ra->code(), 0) << ra->message();
  ExpectSameBits(*client::FromWire(ra->backward().grad_input()),
                 *client::FromWire(rb->backward().grad_input()), "grad_input");
  EXPECT_TRUE(sa->Finish().ok());
  EXPECT_TRUE(sb->Finish().ok());
  ExpectSameTensors(*exact_->GetGradients(ma), *f32_->GetGradients(mb), "gradients");
}

// The FP8 wire under BLOCK and MXFP8 scales each tensor by the recipe's row blocks both ways
// (docs/wire.md, "Block scales"): one outlier of 3e6 in row 0 leaves the other rows' outputs
// as close to the F32 wire's as a clean batch's are, where one scale for the tensor (CURRENT)
// loses them; the results come back with their blocks (seen on the Train stream's messages).
TEST_P(ExactWireTest, TheFp8WireKeepsAnOutlierToItsRowUnderBlockRecipes) {
  client::ClientOptions options;
  options.wire_dtype = WireDType::kFp8E4M3;
  options.shared_memory = GetParam();
  options.shared_memory_min_kib = 4;
  auto fp8 = server_.Connect(options);
  const HostTensor x = Random({32, 256});
  HostTensor outlier = x;
  outlier.data[3] = 3e6f;
  for (v1::ScalingRecipe recipe : {v1::BLOCK, v1::MXFP8, v1::CURRENT}) {
    SCOPED_TRACE(client::RecipeName(recipe));
    const v1::ModuleSpec spec = WithRecipe(testing::LinearSpec(256, 128, true, 21), recipe);
    const std::string m8 = fp8->CreateModule(spec)->module_id();
    const std::string mf = f32_->CreateModule(spec)->module_id();
    // The worst relative error of rows 1..31 of the FP8 wire's output against the F32 wire's.
    auto rows_error = [&](const HostTensor& in) {
      auto a = fp8->Forward(m8, in, false);
      auto b = f32_->Forward(mf, in, false);
      EXPECT_TRUE(a.ok() && b.ok());
      if (!a.ok() || !b.ok()) return 0.0;
      double worst = 0.0;
      for (int64_t r = 1; r < 32; ++r) {
        double diff = 0.0, ref = 0.0;
        for (int64_t c = 0; c < 128; ++c) {
          const size_t i = size_t(r * 128 + c);
          diff = std::max(diff, std::fabs(double(a->output.data[i]) - double(b->output.data[i])));
          ref = std::max(ref, std::fabs(double(b->output.data[i])));
        }
        worst = std::max(worst, diff / ref);
      }
      return worst;
    };
    const double clean = rows_error(x), with_outlier = rows_error(outlier);
    EXPECT_GT(clean, 0.0);  // the FP8 wire rounds
    EXPECT_LT(clean, 0.2);
    if (recipe == v1::CURRENT) {
      EXPECT_GT(with_outlier, 0.5) << "one scale for the tensor: the other rows are lost";
      continue;
    }
    EXPECT_LE(with_outlier, 1.5 * clean) << "clean " << clean;
    // The results' form, on the stream's messages.
    const int64_t block = recipe == v1::BLOCK ? 128 : 32;
    auto stream = fp8->OpenTrainStream();
    ASSERT_TRUE(stream->SendForward(1, m8, outlier, true));
    auto r = stream->Read();
    ASSERT_TRUE(r);
    ASSERT_EQ(r->code(), 0) << r->message();
    const v1::Tensor& y = r->forward().output();
    EXPECT_EQ(y.dtype(), v1::FP8_E4M3);
    EXPECT_EQ(y.scale_inv(), 0.0f);
    EXPECT_EQ(y.block_scales().block_rows(), 1);
    EXPECT_EQ(y.block_scales().block_cols(), block);
    ASSERT_TRUE(stream->SendBackward(2, r->forward().context_id(), Random({32, 128})));
    r = stream->Read();
    ASSERT_TRUE(r);
    ASSERT_EQ(r->code(), 0) << r->message();
    EXPECT_EQ(r->backward().grad_input().block_scales().block_cols(), block);
    EXPECT_TRUE(stream->Finish().ok());
  }
}

INSTANTIATE_TEST_SUITE_P(
    SharedMemory, ExactWireTest,
    ::testing::Values(client::ClientOptions::SharedMemory::kOff,
                      client::ClientOptions::SharedMemory::kAuto),
    [](const ::testing::TestParamInfo<client::ClientOptions::SharedMemory>& p) {
      return std::string(p.param == client::ClientOptions::SharedMemory::kOff ? "Wire"
                                                                              : "SharedMemoryAuto");
    });

}  // namespace
}  // namespace gradwire
