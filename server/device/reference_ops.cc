#include "server/device/reference_ops.h"

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>

#include "gradwire/kernels/ref/cast.h"
#include "gradwire/kernels/ref/gemm.h"
#include "gradwire/kernels/ref/layernorm.h"
#include "server/device/quantizer.h"

namespace gradwire::device {
namespace {

at::TensorOptions Float32() { return at::TensorOptions().dtype(at::kFloat); }

kernels::Fp8Operand Operand(const at::Tensor& codes, const Fp8Tensor& t, bool transposed) {
  return kernels::Fp8Operand{codes.data_ptr<uint8_t>(), t.format, t.scale_inv(), transposed};
}

at::Tensor EmptyFloat(int64_t rows, int64_t cols) { return at::empty({rows, cols}, Float32()); }

// Runs one GEMM and counts its work.
void RunGemm(const kernels::Fp8GemmArgs& gemm) {
  const auto start = std::chrono::steady_clock::now();
  kernels::Fp8Gemm(gemm);
  CountGemm(2.0 * double(gemm.m) * double(gemm.n) * double(gemm.k),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

// A block-scaled GEMM (docs/block-scaling.md): both operands dequantized exactly, block by block,
// then the reference's ordered sum with scale 1. a is [m, k] and b is [n, k] as stored copies
// (`a_rowwise`, `b_rowwise` say which).
void RunBlockGemm(const Fp8Tensor& a, bool a_rowwise, const Fp8Tensor& b, bool b_rowwise, int64_t m,
                  int64_t n, int64_t k, float* c, const float* bias, bool accumulate) {
  const auto start = std::chrono::steady_clock::now();
  const at::Tensor av = Dequantize(a, a_rowwise);
  const at::Tensor bv = Dequantize(b, b_rowwise);
  kernels::FloatGemm(av.data_ptr<float>(), bv.data_ptr<float>(), m, n, k, c, bias, accumulate);
  CountGemm(2.0 * double(m) * double(n) * double(k),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

}  // namespace

at::Tensor Fp8Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias) {
  at::Tensor y = EmptyFloat(x.rows, w.rows);
  if (x.block_scaled || w.block_scaled) {
    RunBlockGemm(x, true, w, true, x.rows, w.rows, x.cols, y.data_ptr<float>(),
                 bias.defined() ? bias.data_ptr<float>() : nullptr, false);
    return y;
  }
  kernels::Fp8GemmArgs gemm;
  gemm.a = Operand(x.rowwise, x, /*transposed=*/false);
  gemm.b = Operand(w.rowwise, w, /*transposed=*/true);
  gemm.m = x.rows;
  gemm.n = w.rows;
  gemm.k = x.cols;
  gemm.c = y.data_ptr<float>();
  gemm.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  RunGemm(gemm);
  return y;
}

at::Tensor Fp8Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) {
  at::Tensor dx = EmptyFloat(dy.rows, w.cols);
  if (dy.block_scaled || w.block_scaled) {  // W^T [K, N]: the columnwise copy
    RunBlockGemm(dy, true, w, false, dy.rows, w.cols, dy.cols, dx.data_ptr<float>(), nullptr,
                 false);
    return dx;
  }
  kernels::Fp8GemmArgs gemm;
  gemm.a = Operand(dy.rowwise, dy, false);
  gemm.b = Operand(w.columnwise, w, true);  // W^T stored [K, N]: contiguous along N
  gemm.m = dy.rows;
  gemm.n = w.cols;
  gemm.k = dy.cols;
  gemm.c = dx.data_ptr<float>();
  RunGemm(gemm);
  return dx;
}

void Fp8Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc, bool accumulate) {
  if (dy.block_scaled || x.block_scaled) {  // dY^T [N, M] and X^T [K, M]: the columnwise copies
    RunBlockGemm(dy, false, x, false, dy.cols, x.cols, dy.rows, acc.data_ptr<float>(), nullptr,
                 accumulate);
    return;
  }
  kernels::Fp8GemmArgs gemm;
  gemm.a = Operand(dy.columnwise, dy, false);  // dY^T stored [N, M]
  gemm.b = Operand(x.columnwise, x, true);     // X^T stored [K, M]
  gemm.m = dy.cols;
  gemm.n = x.cols;
  gemm.k = dy.rows;
  gemm.c = acc.data_ptr<float>();
  gemm.accumulate = accumulate;
  RunGemm(gemm);
}

void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) {
  const int64_t rows = g.size(0), cols = g.size(1);
  std::vector<float> sums(static_cast<size_t>(cols));
  const at::Tensor f = g.scalar_type() == at::kFloat ? g.contiguous() : g.to(at::kFloat);  // exact
  kernels::ColumnSums(f.data_ptr<float>(), rows, cols, sums.data());
  float* out = acc.data_ptr<float>();
  for (int64_t c = 0; c < cols; ++c) out[c] += sums[size_t(c)];
}

at::Tensor RunLayerNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mu,
                                const at::Tensor& rstd, const LayerNormParams& ln,
                                at::Tensor& gamma_grad, at::Tensor& beta_grad) {
  at::Tensor dx = at::empty_like(x);
  kernels::LayerNormBackward(dy.data_ptr<float>(), x.data_ptr<float>(), mu.data_ptr<float>(),
                             rstd.data_ptr<float>(), ln.gamma.data_ptr<float>(), x.size(0),
                             x.size(1), ln.zero_centered_gamma, dx.data_ptr<float>(),
                             gamma_grad.data_ptr<float>(), beta_grad.data_ptr<float>());
  return dx;
}

LayerNormOut RunLayerNorm(const at::Tensor& x, const LayerNormParams& ln) {
  LayerNormOut out;
  out.y = at::empty_like(x);
  out.mu = at::empty({x.size(0)}, Float32());  // per row
  out.rstd = at::empty_like(out.mu);
  kernels::LayerNormForward(x.data_ptr<float>(), x.size(0), x.size(1), ln.gamma.data_ptr<float>(),
                            ln.beta.data_ptr<float>(), ln.eps, ln.zero_centered_gamma,
                            out.y.data_ptr<float>(), out.mu.data_ptr<float>(),
                            out.rstd.data_ptr<float>());
  return out;
}

kernels::Fp8Format Fp8FormatOf(wire::DType dtype) {
  return dtype == wire::DType::kFp8E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2;
}

at::Tensor BorrowF32(const wire::TensorView& v, int64_t rows, int64_t cols) {
  if (v.dtype != wire::DType::kF32 || reinterpret_cast<uintptr_t>(v.data) % alignof(float) != 0) {
    return at::Tensor();
  }
  return at::from_blob(const_cast<void*>(v.data), {rows, cols}, Float32());
}

wire::EncodedTensor Bf16AsItIs(const at::Tensor& x, std::vector<int64_t> shape) {
  const at::Tensor src = x.contiguous();
  wire::EncodedTensor out = EncodedFor(wire::DType::kBF16, std::move(shape), src.numel());
  if (!out.bytes.empty()) std::memcpy(out.bytes.data(), src.data_ptr(), out.bytes.size());
  return out;
}

wire::EncodedTensor EncodedFor(wire::DType dtype, std::vector<int64_t> shape, int64_t n) {
  wire::EncodedTensor out;
  out.dtype = dtype;
  out.shape = std::move(shape);
  out.bytes.resize(size_t(n * wire::ElementSize(dtype)));
  return out;
}

}  // namespace gradwire::device
