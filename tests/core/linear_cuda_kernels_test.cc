// The CUDA kernels composed into an FP8 Linear step exactly as the GPU benchmark composes them
// (current scaling, E4M3 forward, E5M2 gradients, TN GEMMs on rowwise/columnwise copies), against
// the server's own Linear module (server/core/kinds/linear.cc) on the same fresh random inputs: the
// casts bit for bit, the GEMM outputs within an fp32 accumulation-order bound of the module's.
// This checks the operand layouts and scale wiring, not just each kernel. Skipped, visibly,
// without a CUDA device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gradwire/kernels/cuda/cast.h"
#include "gradwire/kernels/cuda/gemm_lt.h"
#include "gradwire/kernels/dtype.h"
#include "server/core/kinds/linear.h"
#include "server/device/quantizer.h"
#include "test_util.h"
#include "tests/kernels/cuda_test_util.h"

namespace gradwire::kernels::cuda {
namespace {

using gradwire::testing::AmaxOf;
using gradwire::testing::GemmParams;
using gradwire::testing::GemmSpec;
using gradwire::testing::Into;
using gradwire::testing::kE5M2;
using gradwire::testing::MakeBwdArgs;
using gradwire::testing::MakeFwdArgs;
using gradwire::testing::SavedAs;
using testing::Bits;
using testing::DeviceBuffer;

std::vector<float> Floats(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}
std::vector<uint8_t> Bytes(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::vector<uint8_t>(c.data_ptr<uint8_t>(), c.data_ptr<uint8_t>() + c.numel());
}
at::Tensor FromFloats(const std::vector<float>& v, int64_t rows, int64_t cols) {
  return at::from_blob(const_cast<float*>(v.data()), {rows, cols}, at::kFloat).clone();
}

// An FP8 cast on the device with current scaling: codes, transposed codes and scalars.
struct Cast {
  DeviceBuffer<uint8_t> data, data_t;
  DeviceBuffer<float> scale{1}, scale_inv{1}, amax{1};
  Fp8Output out;
  Cast(int64_t n, Fp8Format format) : data(static_cast<size_t>(n)), data_t(static_cast<size_t>(n)) {
    out.format = format;
    out.scale = scale.get();
    out.current = true;
    out.data = data.get();
    out.data_t = data_t.get();
    out.amax = amax.get();
    out.scale_inv = scale_inv.get();
  }
};

LtGemmArgs Gemm(const Cast& a, const uint8_t* a_codes, const Cast& b, const uint8_t* b_codes,
                int64_t m, int64_t n, int64_t k, float* d) {
  LtGemmArgs g;
  g.a = a_codes;
  g.a_format = a.out.format;
  g.a_scale_inv = a.scale_inv.get();
  g.b = b_codes;
  g.b_format = b.out.format;
  g.b_scale_inv = b.scale_inv.get();
  g.m = m;
  g.n = n;
  g.k = k;
  g.d = d;
  g.accumulation = GemmAccumulation::kSplit;
  return g;
}

// |got - want| <= (2 k 2^-24 + 2^-12) terms + 1e-5, elementwise; terms = sum |summands| of the
// dequantized product (both sides multiply the same FP8 values).
::testing::AssertionResult CloseToModule(const std::vector<float>& got, const at::Tensor& want,
                                         const at::Tensor& terms, int64_t k) {
  const at::Tensor g = FromFloats(got, want.size(0), want.size(1)).to(at::kDouble);
  const at::Tensor bound =
      (2.0 * double(k) * std::ldexp(1.0, -24) + std::ldexp(1.0, -12)) * terms.to(at::kDouble) +
      1e-5;
  const at::Tensor excess = (g - want.to(at::kDouble)).abs() - bound;
  const double worst = excess.max().item<double>();
  if (worst <= 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "exceeds the bound by " << worst << " at element " << excess.argmax().item<int64_t>();
}

TEST(CudaLinear, StepMatchesTheCoreModule) {
  GW_REQUIRE_CUDA_DEVICE();
  // Multiples of 16 with prime factors: M = 16*13, K = 16*7, N = 16*31.
  const int64_t M = 208, K = 112, N = 496;
  at::manual_seed(int64_t(testing::FreshSeed() >> 1));
  const at::Tensor x = at::randn({M, K}), w = at::randn({N, K}) / std::sqrt(double(K)),
                   dy = at::randn({M, N});
  // A bias exactly representable in bf16, the GEMM epilogue's bias type.
  std::vector<float> bias_v = Floats(at::randn({N}));
  for (float& b : bias_v) b = Bf16ToFloat(FloatToBf16(b));
  const at::Tensor bias = at::from_blob(bias_v.data(), {N}, at::kFloat).clone();

  const core::ModuleSpec spec = GemmSpec(core::ModuleKind::kLinear, w, bias);
  auto fwd = core::LinearForward(MakeFwdArgs(spec, x, GemmParams(w, bias), /*training=*/true));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  const device::Fp8Tensor& wq = fwd->workspace->weights[0];
  const device::Fp8Tensor& xq = SavedAs<core::LinearSaved>(*fwd).input;  // columnwise only
  at::Tensor weight_grad = at::randn({N, K}), bias_grad = at::randn({N});
  const std::vector<float> weight_grad0 = Floats(weight_grad);
  const std::vector<float> bias_grad0 = Floats(bias_grad);
  core::DirectGradients grads = Into(weight_grad, bias_grad);
  auto bwd = core::LinearBackward(MakeBwdArgs(spec, dy, fwd->saved.get(), &grads));
  ASSERT_TRUE(bwd.ok()) << bwd.status();

  // The same step on the device.
  DeviceBuffer<float> dx_in(Floats(x)), dw_in(Floats(w)), ddy(Floats(dy));
  std::vector<uint16_t> bias16(static_cast<size_t>(N));
  FloatToBf16(bias_v.data(), N, bias16.data());
  DeviceBuffer<uint16_t> dbias16(bias16);
  Cast cx(M * K, Fp8Format::kE4M3), cw(N * K, Fp8Format::kE4M3), cg(M * N, Fp8Format::kE5M2);
  DeviceBuffer<float> y(static_cast<size_t>(M * N)), dx(static_cast<size_t>(M * K)),
      dW(weight_grad0), dbias(static_cast<size_t>(N));
  CastTranspose(dw_in.get(), N, K, cw.out, nullptr);
  CastTranspose(dx_in.get(), M, K, cx.out, nullptr);
  LtGemmArgs fprop = Gemm(cx, cx.data.get(), cw, cw.data.get(), M, N, K, y.get());
  fprop.accumulation = GemmAccumulation::kFast;
  fprop.epilogue = GemmEpilogue::kBias;
  fprop.bias = dbias16.get();
  Fp8GemmLt(fprop);
  CastTransposeDbias(ddy.get(), M, N, cg.out, dbias.get(), nullptr);
  Fp8GemmLt(Gemm(cg, cg.data.get(), cw, cw.data_t.get(), M, K, N, dx.get()));
  LtGemmArgs wgrad = Gemm(cg, cg.data_t.get(), cx, cx.data_t.get(), N, K, M, dW.get());
  wgrad.accumulate = true;
  Fp8GemmLt(wgrad);

  // Casts: the module's workspace and saved input, bit for bit.
  EXPECT_EQ(cw.data.Download(), Bytes(wq.rowwise));
  EXPECT_EQ(cw.data_t.Download(), Bytes(wq.columnwise));
  EXPECT_EQ(Bits(cw.scale_inv.Scalar()), Bits(wq.scale_inv()));
  EXPECT_EQ(cx.data_t.Download(), Bytes(xq.columnwise));
  EXPECT_EQ(Bits(cx.scale_inv.Scalar()), Bits(xq.scale_inv()));
  EXPECT_EQ(Bits(cx.amax.Scalar()), Bits(AmaxOf(fwd->amaxes, core::kInputRole)));
  EXPECT_EQ(Bits(cg.amax.Scalar()), Bits(AmaxOf(bwd->amaxes, core::kGradOutputRole)));

  // GEMMs against the module's outputs.
  const at::Tensor xd = device::Dequantize(xq, false).t().to(at::kDouble);  // [M, K]
  const at::Tensor wd = device::Dequantize(wq, true).to(at::kDouble);       // [N, K]
  const at::Tensor gq = device::Dequantize(*device::Quantize(dy, kE5M2, {true, false}), true)
                            .to(at::kDouble);  // [M, N]
  EXPECT_TRUE(CloseToModule(y.Download(), fwd->output,
                            at::matmul(xd.abs(), wd.abs().t()) + bias.abs().to(at::kDouble), K));
  EXPECT_TRUE(CloseToModule(dx.Download(), bwd->grad_input, at::matmul(gq.abs(), wd.abs()), N));
  EXPECT_TRUE(CloseToModule(
      dW.Download(), weight_grad,
      at::matmul(gq.abs().t(), xd.abs()) + FromFloats(weight_grad0, N, K).abs().to(at::kDouble),
      M));
  // dbias: the module accumulated onto bias_grad0; the kernel wrote the sums alone.
  const std::vector<float> got_db = dbias.Download(), want_db = Floats(bias_grad);
  for (int64_t n = 0; n < N; ++n) {
    ASSERT_NEAR(got_db[size_t(n)] + bias_grad0[size_t(n)], want_db[size_t(n)],
                1e-5 * (1.0 + double(M)) * 4.0)
        << "dbias " << n;
  }
}

}  // namespace
}  // namespace gradwire::kernels::cuda
