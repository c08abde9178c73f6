// The reference backend's LayerNorm and activation kernels (kernels/ref/layernorm.cc,
// kernels/ref/activation.cc) against float64 libtorch autograd, forward and backward.
#include <gtest/gtest.h>

#include <cmath>
#include <utility>

#include "gradwire/kernels/ref/activation.h"
#include "gradwire/kernels/ref/layernorm.h"
#include "test_util.h"

namespace gradwire::kernels {
namespace {

using gradwire::testing::Act64;
using gradwire::testing::AllClose;
using gradwire::testing::D;
using gradwire::testing::RandN;

TEST(LayerNormKernelTest, MatchesFloat64Autograd) {
  for (bool zero_centered : {false, true}) {
    for (auto [m, k] : {std::pair<int64_t, int64_t>{1, 1}, {7, 13}, {33, 64}}) {
      const at::Tensor x = RandN({m, k}, 3.0) + 1.5, gamma = RandN({k}), beta = RandN({k});
      const at::Tensor dy = RandN({m, k});
      at::Tensor y = at::empty({m, k}), mu = at::empty({m}), rstd = at::empty({m});
      kernels::LayerNormForward(x.data_ptr<float>(), m, k, gamma.data_ptr<float>(),
                                beta.data_ptr<float>(), 1e-5f, zero_centered, y.data_ptr<float>(),
                                mu.data_ptr<float>(), rstd.data_ptr<float>());
      at::Tensor dx = at::full({m, k}, NAN), dgamma = RandN({k}), dbeta = RandN({k});
      const at::Tensor dgamma0 = dgamma.clone(), dbeta0 = dbeta.clone();
      kernels::LayerNormBackward(dy.data_ptr<float>(), x.data_ptr<float>(), mu.data_ptr<float>(),
                                 rstd.data_ptr<float>(), gamma.data_ptr<float>(), m, k,
                                 zero_centered, dx.data_ptr<float>(), dgamma.data_ptr<float>(),
                                 dbeta.data_ptr<float>());
      at::Tensor x64 = D(x).set_requires_grad(true), g64 = D(gamma).set_requires_grad(true),
                 b64 = D(beta).set_requires_grad(true);
      at::Tensor y64 = at::layer_norm(x64, {k}, zero_centered ? g64 + 1 : g64, b64, 1e-5);
      y64.backward(D(dy));
      EXPECT_TRUE(AllClose(y, y64, 1e-5, 1e-5));
      EXPECT_TRUE(AllClose(dx, x64.grad(), 1e-4, 1e-4));
      EXPECT_TRUE(AllClose(D(dgamma) - D(dgamma0), g64.grad(), 1e-4, 1e-4));
      EXPECT_TRUE(AllClose(D(dbeta) - D(dbeta0), b64.grad(), 1e-5, 1e-5));
    }
  }
}

class ActivationKernelTest : public ::testing::TestWithParam<Activation> {};

TEST_P(ActivationKernelTest, ForwardAndBackwardMatchFloat64Autograd) {
  const Activation act = GetParam();
  const int64_t m = 9, w = 17, in_w = kernels::IsGated(act) ? 2 * w : w;
  const at::Tensor in = RandN({m, in_w}, 2.0), dout = RandN({m, w});
  at::Tensor out = at::full({m, w}, NAN), din = at::full({m, in_w}, NAN);
  kernels::ActivationForward(act, in.data_ptr<float>(), m, w, out.data_ptr<float>());
  kernels::ActivationBackward(act, dout.data_ptr<float>(), in.data_ptr<float>(), m, w,
                              din.data_ptr<float>());
  at::Tensor in64 = D(in).set_requires_grad(true);
  at::Tensor out64 = Act64(act, in64, w);
  out64.backward(D(dout));
  EXPECT_TRUE(AllClose(out, out64, 1e-5, 1e-6));
  EXPECT_TRUE(AllClose(din, in64.grad(), 1e-5, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(All, ActivationKernelTest,
                         ::testing::Values(Activation::kGelu, Activation::kRelu,
                                           Activation::kSwiglu, Activation::kGeglu),
                         [](const auto& info) { return kernels::ActivationName(info.param); });

}  // namespace
}  // namespace gradwire::kernels
