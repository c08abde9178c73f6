// Every pairing of wire dtypes for activations and gradients, FP8 included, and FP8 input used as
// it arrives (not re-quantized).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "gradwire/client/client.h"
#include "gradwire/kernels/ref/cast.h"
#include "gradwire/kernels/ref/gemm.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire {
namespace {

using client::HostTensor;
using client::WireDType;

constexpr WireDType kAll[] = {WireDType::kF32, WireDType::kBF16, WireDType::kF16,
                              WireDType::kFp8E4M3, WireDType::kFp8E5M2};
const char* Name(WireDType d) {
  static const char* names[] = {"F32", "BF16", "F16", "FP8_E4M3", "FP8_E5M2"};
  return names[int(d)];
}
// Relative RMS error, measured against the all-F32 run, that a dtype may add (about twice what
// was measured on random tensors). As an input it is rounded once by the client and then re-cast
// by the server (activations to E4M3, gradients to E5M2), so its error compounds with that cast;
// as an output it is one rounding of the result.
double InputTolerance(WireDType d) {
  static const double tol[] = {0.0, 0.06, 0.03, 0.15, 0.15};
  return tol[int(d)];
}
double OutputTolerance(WireDType d) {
  static const double tol[] = {0.0, 0.004, 0.0005, 0.05, 0.1};
  return tol[int(d)];
}

using testing::Random;
double RelativeError(const HostTensor& a, const HostTensor& ref) {
  if (a.data.size() != ref.data.size()) return HUGE_VAL;  // a failed call's empty answer
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.data.size(); ++i) {
    num += (double(a.data[i]) - ref.data[i]) * (double(a.data[i]) - ref.data[i]);
    den += double(ref.data[i]) * ref.data[i];
  }
  return std::sqrt(num / den);
}

class WireDTypeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.ok());
    client_ = server_.Connect();
    v1::ModuleSpec spec = testing::LinearSpec(64, 48, true, 5);
    module_ = client_->CreateModule(spec)->module_id();
  }

  HostTensor Forward(const HostTensor& x, WireDType in, WireDType out, bool training,
                     std::string* context = nullptr) {
    v1::ForwardRequest req;
    req.set_module_id(module_);
    *req.mutable_input() = client::ToWire(x, in);
    req.set_output_dtype(client::ToProto(out));
    req.set_training(training);
    v1::ForwardResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status s = client_->stub().Forward(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    if (!s.ok()) return {};
    EXPECT_EQ(resp.output().dtype(), client::ToProto(out));
    if (context) *context = resp.context_id();
    return *client::FromWire(resp.output());
  }

  HostTensor Backward(const std::string& context, const HostTensor& dy, WireDType in,
                      WireDType out) {
    v1::BackwardRequest req;
    req.set_context_id(context);
    *req.mutable_grad_output() = client::ToWire(dy, in);
    req.set_grad_input_dtype(client::ToProto(out));
    v1::BackwardResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status s = client_->stub().Backward(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    if (!s.ok()) return {};
    return *client::FromWire(resp.grad_input());
  }

  testing::TestServer server_;
  std::unique_ptr<client::Client> client_;
  std::string module_;
};

TEST_F(WireDTypeTest, EveryPairingOfInputAndOutputDTypes) {
  const HostTensor x = Random({16, 64});
  const HostTensor dy = Random({16, 48});
  // The all-F32 run is the reference; the same input through the same weights.
  std::string ref_ctx;
  const HostTensor y_ref = Forward(x, WireDType::kF32, WireDType::kF32, true, &ref_ctx);
  const HostTensor dx_ref = Backward(ref_ctx, dy, WireDType::kF32, WireDType::kF32);
  std::printf("%-9s %-9s %12s %12s\n", "in", "out", "fwd rel err", "bwd rel err");
  for (WireDType in : kAll) {
    for (WireDType out : kAll) {
      std::string ctx;
      const HostTensor y = Forward(x, in, out, true, &ctx);
      const HostTensor dx = Backward(ctx, dy, in, out);
      const double fe = RelativeError(y, y_ref), be = RelativeError(dx, dx_ref);
      std::printf("%-9s %-9s %12.5f %12.5f\n", Name(in), Name(out), fe, be);
      const double tol = InputTolerance(in) + OutputTolerance(out) + 1e-6;
      EXPECT_LE(fe, tol) << Name(in) << " -> " << Name(out);
      EXPECT_LE(be, tol) << Name(in) << " -> " << Name(out);
      if (in == WireDType::kF32 && out == WireDType::kF32) {
        EXPECT_EQ(fe, 0.0);  // deterministic
      }
    }
  }
  EXPECT_EQ(server_.host().Stats().live_contexts, 0);
}

// FP8 input codes are used as they came: the output is bit-for-bit the FP8 GEMM of exactly those
// codes (with the module's E4M3 weight), not of a re-quantized copy.
TEST_F(WireDTypeTest, Fp8InputIsUsedWithoutRequantizing) {
  // Codes cast with a scale that leaves headroom (amax maps to 100, not 448): re-quantizing the
  // dequantized values with current scaling would produce other codes.
  const HostTensor x = Random({8, 64});
  float amax = 0;
  for (float v : x.data) amax = std::max(amax, std::fabs(v));
  const float scale = 100.0f / amax;
  v1::Tensor wire;
  wire.set_dtype(v1::FP8_E4M3);
  wire.add_shape(8);
  wire.add_shape(64);
  std::string codes(x.data.size(), '\0');
  kernels::QuantizeFp8(x.data.data(), 1, int64_t(x.data.size()), scale, kernels::Fp8Format::kE4M3,
                       reinterpret_cast<uint8_t*>(codes.data()), nullptr, nullptr);
  wire.set_data(codes);
  wire.set_scale_inv(1.0f / scale);

  v1::ForwardRequest req;
  req.set_module_id(module_);
  *req.mutable_input() = wire;
  v1::ForwardResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(client_->stub().Forward(&ctx, req, &resp).ok());
  const HostTensor y = *client::FromWire(resp.output());

  // Expected: the reference GEMM on the sent codes and the weight cast as the server casts it.
  auto weights = client_->GetWeights(module_);
  ASSERT_TRUE(weights.ok());
  const HostTensor& w = *weights->Find("weight");
  const HostTensor& b = *weights->Find("bias");
  const float w_scale =
      kernels::ComputeScale(kernels::Amax(w.data.data(), w.numel()), kernels::Fp8Format::kE4M3, 0);
  std::vector<uint8_t> w_codes(w.data.size());
  kernels::QuantizeFp8(w.data.data(), 48, 64, w_scale, kernels::Fp8Format::kE4M3, w_codes.data(),
                       nullptr, nullptr);
  std::vector<float> expected(8 * 48);
  kernels::Fp8GemmArgs g;
  g.a = {reinterpret_cast<const uint8_t*>(codes.data()), kernels::Fp8Format::kE4M3, 1.0f / scale,
         false};
  g.b = {w_codes.data(), kernels::Fp8Format::kE4M3, 1.0f / w_scale, true};
  g.m = 8;
  g.n = 48;
  g.k = 64;
  g.c = expected.data();
  g.bias = b.data.data();
  kernels::Fp8Gemm(g);
  ASSERT_EQ(y.data.size(), expected.size());
  // The server's CPU backend runs the GEMM on BLAS: the same exact FP8 products, summed in
  // another order, so equal to the reference within the fp32 accumulation bound
  // (k 2^-24 of the sum of |products|, twice for the two orders). The CUDA backend's forward GEMM
  // uses fast accumulation, whose partial sums keep fewer bits: measured up to 3.5e-4 of the sum
  // of |products| on the H100, bounded by p = 2^-10 of it (docs/cuda.md, the parity harness's
  // bound), which this adds on any backend but the CPU and the reference.
  const std::string backend = server_.host().backend().name();
  const double partial_sums =
      backend == "cpu" || backend == "reference" ? 0.0 : std::ldexp(1.0, -10);
  const float* ta = kernels::DecodeTable(kernels::Fp8Format::kE4M3);
  std::vector<double> bound(expected.size());
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t j = 0; j < 48; ++j) {
      double terms = 0;
      for (int64_t k = 0; k < 64; ++k) {
        terms += std::fabs(double(ta[uint8_t(codes[size_t(i * 64 + k)])]) *
                           double(ta[w_codes[size_t(j * 64 + k)]]));
      }
      bound[size_t(i * 48 + j)] =
          (2.0 * 64 * std::ldexp(1.0, -24) + partial_sums) * terms / scale / w_scale +
          std::ldexp(1.0, -23) * std::fabs(expected[size_t(i * 48 + j)]);
    }
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_NEAR(y.data[i], expected[i], bound[i]) << i;
  }

  // The same values sent as F32 are re-quantized with current scaling: other codes, other bits.
  HostTensor dequantized = HostTensor::Zeros({8, 64});
  kernels::DequantizeFp8(reinterpret_cast<const uint8_t*>(codes.data()), 8 * 64, 1.0f / scale,
                         kernels::Fp8Format::kE4M3, dequantized.data.data());
  const HostTensor y_f32 = Forward(dequantized, WireDType::kF32, WireDType::kF32, false);
  ASSERT_EQ(y_f32.data.size(), expected.size());
  bool beyond_rounding = false;
  for (size_t i = 0; i < expected.size(); ++i) {
    beyond_rounding |= std::fabs(double(y_f32.data[i]) - expected[i]) > 4 * bound[i];
  }
  EXPECT_TRUE(beyond_rounding) << "re-quantized input gave the FP8 input's outputs";
}

TEST_F(WireDTypeTest, Fp8OutputsCarryTheirScaleAndBadFp8InputIsRefused) {
  const HostTensor x = Random({4, 64});
  v1::ForwardRequest req;
  req.set_module_id(module_);
  *req.mutable_input() = client::ToWire(x, WireDType::kF32);
  req.set_output_dtype(v1::FP8_E5M2);
  v1::ForwardResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(client_->stub().Forward(&ctx, req, &resp).ok());
  }
  EXPECT_EQ(resp.output().dtype(), v1::FP8_E5M2);
  EXPECT_EQ(resp.output().data().size(), 4u * 48u);  // one byte per element: a quarter of F32
  EXPECT_GT(resp.output().scale_inv(), 0.0f);
  // Zero scale_inv on FP8 input: INVALID_ARGUMENT naming the field.
  *req.mutable_input() = client::ToWire(x, WireDType::kFp8E4M3);
  req.mutable_input()->set_scale_inv(0.0f);
  grpc::ClientContext ctx;
  const grpc::Status s = client_->stub().Forward(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("input.scale_inv"), std::string::npos) << s.error_message();
}

}  // namespace
}  // namespace gradwire
