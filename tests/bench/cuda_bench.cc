// GPU benchmark of the CUDA backend: FP8 GEMM TFLOP/s, and forward+backward step times of a
// Linear and a LayerNormMLP composed from the backend's kernels as the modules compose them
// (current scaling, E4M3 forward, E5M2 gradients, weights cast once as the workspace cache does),
// and of the Linear with bf16 activations and gradients in and out (linear_bf16).
// Prints a table and writes JSON (--json PATH); scripts/device/bench_torch.py adds PyTorch.
// Times are CUDA-event times averaged over --iters runs after warm-up; nothing passes or fails.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "check.h"
#include "device_query.h"
#include "gradwire/kernels/cuda/activation.h"
#include "gradwire/kernels/cuda/cast.h"
#include "gradwire/kernels/cuda/gemm_lt.h"
#include "gradwire/kernels/cuda/layernorm.h"

namespace gwc = gradwire::kernels::cuda;
using gradwire::kernels::Activation;
using gradwire::kernels::Fp8Format;

namespace {

// Device memory freed at scope exit.
struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { GRADWIRE_CUDA_CHECK(cudaMalloc(&p, bytes)); }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Fills n floats with normal-ish values (sum of uniforms) from a host xorshift, uploaded once.
void FillRandom(float* dev, size_t n, uint64_t seed, float spread) {
  std::vector<float> host(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    float acc = 0;
    for (int j = 0; j < 3; ++j) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      acc += float(s >> 40) / float(1ull << 24) - 0.5f;
    }
    host[i] = acc * spread;
  }
  GRADWIRE_CUDA_CHECK(cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  // A pageable copy may return before its DMA lands, and the benchmarks read on another stream.
  GRADWIRE_CUDA_CHECK(cudaDeviceSynchronize());
}

// FillRandom's values rounded to bfloat16 (round to nearest even), as raw 16-bit patterns.
void FillRandomBf16(uint16_t* dev, size_t n, uint64_t seed, float spread) {
  std::vector<float> values(n);
  Buf tmp(n * sizeof(float));
  FillRandom(tmp.as<float>(), n, seed, spread);
  GRADWIRE_CUDA_CHECK(cudaMemcpy(values.data(), tmp.p, n * sizeof(float), cudaMemcpyDeviceToHost));
  std::vector<uint16_t> host(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &values[i], 4);
    host[i] = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // finite inputs only
  }
  GRADWIRE_CUDA_CHECK(cudaMemcpy(dev, host.data(), n * 2, cudaMemcpyHostToDevice));
  GRADWIRE_CUDA_CHECK(cudaDeviceSynchronize());  // as FillRandom
}

// Average milliseconds of fn over iters runs after warmup runs, on stream.
double TimeMs(cudaStream_t stream, int warmup, int iters, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t start, stop;
  GRADWIRE_CUDA_CHECK(cudaEventCreate(&start));
  GRADWIRE_CUDA_CHECK(cudaEventCreate(&stop));
  GRADWIRE_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i) fn();
  GRADWIRE_CUDA_CHECK(cudaEventRecord(stop, stream));
  GRADWIRE_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  GRADWIRE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return double(ms) / iters;
}

// An FP8 tensor on the device: codes, transposed codes, scale, scale_inv, amax. Each scalar
// has a 16-byte slot of its own: cuBLASLt refuses a scale_inv that is not 16-byte aligned.
struct Fp8Dev {
  Buf data, data_t, scalars;  // scalars: scale, scale_inv, amax at 0, 16 and 32 bytes
  Fp8Format format;
  Fp8Dev(int64_t rows, int64_t cols, Fp8Format f)
      : data(static_cast<size_t>(rows * cols)),
        data_t(static_cast<size_t>(rows * cols)),
        scalars(12 * sizeof(float)),
        format(f) {}
  float* scale() const { return scalars.as<float>(); }
  float* scale_inv() const { return scalars.as<float>() + 4; }
  float* amax() const { return scalars.as<float>() + 8; }
  gwc::Fp8Output Out(bool transposed) const {
    gwc::Fp8Output o;
    o.format = format;
    o.scale = scale();
    o.current = true;
    o.data = data.as<uint8_t>();
    o.data_t = transposed ? data_t.as<uint8_t>() : nullptr;
    o.amax = amax();
    o.scale_inv = scale_inv();
    return o;
  }
};

gwc::LtGemmArgs Gemm(const uint8_t* a, const Fp8Dev& as, const uint8_t* b, const Fp8Dev& bs,
                     int64_t m, int64_t n, int64_t k, float* d, bool accumulate,
                     gwc::GemmAccumulation acc, cudaStream_t stream) {
  gwc::LtGemmArgs g;
  g.a = a;
  g.a_format = as.format;
  g.a_scale_inv = as.scale_inv();
  g.b = b;
  g.b_format = bs.format;
  g.b_scale_inv = bs.scale_inv();
  g.m = m;
  g.n = n;
  g.k = k;
  g.d = d;
  g.d_type = gwc::GemmOut::kFloat32;
  g.accumulate = accumulate;
  g.accumulation = acc;
  g.stream = stream;
  return g;
}

struct GemmRow {
  int64_t m, n, k;
  double ms, tflops;
};

struct Mnk {
  int64_t m, n, k;
};

// "MxNxK[,MxNxK...]" into `out`. Each size must be a positive multiple of 16, what the FP8 GEMM
// takes unpadded: a typo then fails here, before any device work, not as a failed case.
bool ParseShapes(const std::string& text, std::vector<Mnk>* out) {
  out->clear();
  size_t at = 0;
  while (at <= text.size()) {
    const size_t end = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, end - at);
    long long m = 0, n = 0, k = 0;
    char tail = 0;
    if (std::sscanf(item.c_str(), "%lldx%lldx%lld%c", &m, &n, &k, &tail) != 3) return false;
    for (long long v : {m, n, k}) {
      if (v <= 0 || v % 16 != 0) return false;
    }
    out->push_back({m, n, k});
    at = end + 1;
  }
  return !out->empty();
}

GemmRow BenchGemm(int64_t m, int64_t n, int64_t k, int iters, cudaStream_t stream) {
  Buf fa(static_cast<size_t>(m * k) * 4), fb(static_cast<size_t>(n * k) * 4);
  FillRandom(fa.as<float>(), size_t(m * k), 1, 2.0f);
  FillRandom(fb.as<float>(), size_t(n * k), 2, 2.0f);
  Fp8Dev a(m, k, Fp8Format::kE4M3), b(n, k, Fp8Format::kE4M3);
  gwc::CastTranspose(fa.as<float>(), m, k, a.Out(false), stream);
  gwc::CastTranspose(fb.as<float>(), n, k, b.Out(false), stream);
  Buf d(static_cast<size_t>(m * n) * 2);
  gwc::LtGemmArgs g = Gemm(a.data.as<uint8_t>(), a, b.data.as<uint8_t>(), b, m, n, k, nullptr,
                           false, gwc::GemmAccumulation::kFast, stream);
  g.d = d.p;
  g.d_type = gwc::GemmOut::kBFloat16;  // as torch._scaled_mm is timed
  const double ms = TimeMs(stream, 3, iters, [&] { gwc::Fp8GemmLt(g); });
  return {m, n, k, ms, 2.0 * double(m) * double(n) * double(k) / (ms * 1e-3) / 1e12};
}

struct StepRow {
  std::string name;
  int64_t tokens, hidden, ffn;
  double fwd_ms, bwd_ms, step_ms;
};

// A Linear's forward and backward as the backend composes them, on buffers of its own.
// bf16_io: the activations and gradients in and out as bfloat16, as the GPU fast path moves them
// (the input and grad_output cast straight from bf16, the GEMMs write bf16 y and dx), next to the
// fp32 path the server's CUDA backend runs today. The weight gradient stays fp32 either way.
class LinearStep {
 public:
  LinearStep(int64_t tokens, int64_t h, bool bf16_io, cudaStream_t stream)
      : M(tokens),
        K(h),
        N(h),
        bf16_io_(bf16_io),
        stream_(stream),
        x(static_cast<size_t>(M * K) * Act()),
        w(static_cast<size_t>(N * K) * 4),
        y(static_cast<size_t>(M * N) * Act()),
        dy(static_cast<size_t>(M * N) * Act()),
        dx(static_cast<size_t>(M * K) * Act()),
        dw(static_cast<size_t>(N * K) * 4),
        dbias(static_cast<size_t>(N) * 4),
        xq(M, K, Fp8Format::kE4M3),
        wq(N, K, Fp8Format::kE4M3),
        gq(M, N, Fp8Format::kE5M2) {
    if (bf16_io_) {
      FillRandomBf16(x.as<uint16_t>(), size_t(M * K), 3, 2.0f);
      FillRandomBf16(dy.as<uint16_t>(), size_t(M * N), 5, 0.01f);
    } else {
      FillRandom(x.as<float>(), size_t(M * K), 3, 2.0f);
      FillRandom(dy.as<float>(), size_t(M * N), 5, 0.01f);
    }
    FillRandom(w.as<float>(), size_t(N * K), 4, 0.05f);
    gwc::CastTranspose(w.as<float>(), N, K, wq.Out(true), stream_);  // the workspace, once
    GRADWIRE_CUDA_CHECK(cudaMemsetAsync(dw.p, 0, static_cast<size_t>(N * K) * 4, stream_));
  }

  void Fwd() const {
    if (bf16_io_) {
      gwc::CastTransposeBf16(x.as<uint16_t>(), M, K, xq.Out(true), stream_);
    } else {
      gwc::CastTranspose(x.as<float>(), M, K, xq.Out(true), stream_);
    }
    gwc::LtGemmArgs g = Gemm(xq.data.as<uint8_t>(), xq, wq.data.as<uint8_t>(), wq, M, N, K, nullptr,
                             false, gwc::GemmAccumulation::kFast, stream_);
    g.d = y.p;
    g.d_type = OutType();
    gwc::Fp8GemmLt(g);
  }
  void Bwd() const {
    if (bf16_io_) {
      gwc::CastTransposeDbiasBf16(dy.as<uint16_t>(), M, N, gq.Out(true), dbias.as<float>(),
                                  stream_);
    } else {
      gwc::CastTransposeDbias(dy.as<float>(), M, N, gq.Out(true), dbias.as<float>(), stream_);
    }
    gwc::LtGemmArgs dgrad = Gemm(gq.data.as<uint8_t>(), gq, wq.data_t.as<uint8_t>(), wq, M, K, N,
                                 nullptr, false, gwc::GemmAccumulation::kSplit, stream_);
    dgrad.d = dx.p;
    dgrad.d_type = OutType();
    gwc::Fp8GemmLt(dgrad);
    gwc::Fp8GemmLt(Gemm(gq.data_t.as<uint8_t>(), gq, xq.data_t.as<uint8_t>(), xq, N, K, M,
                        dw.as<float>(), true, gwc::GemmAccumulation::kSplit, stream_));
  }

  const int64_t M, K, N;

 private:
  size_t Act() const { return bf16_io_ ? 2 : 4; }  // bytes per activation or gradient element
  gwc::GemmOut OutType() const {
    return bf16_io_ ? gwc::GemmOut::kBFloat16 : gwc::GemmOut::kFloat32;
  }

  const bool bf16_io_;
  const cudaStream_t stream_;
  Buf x, w, y, dy, dx, dw, dbias;
  Fp8Dev xq, wq, gq;
};

StepRow BenchLinear(int64_t tokens, int64_t h, bool bf16_io, int iters, cudaStream_t stream) {
  const LinearStep step(tokens, h, bf16_io, stream);
  StepRow row{bf16_io ? "linear_bf16" : "linear", tokens, h, 0, 0, 0, 0};
  row.fwd_ms = TimeMs(stream, 3, iters, [&] { step.Fwd(); });
  step.Fwd();
  row.bwd_ms = TimeMs(stream, 3, iters, [&] { step.Bwd(); });
  row.step_ms = TimeMs(stream, 3, iters, [&] {
    step.Fwd();
    step.Bwd();
  });
  return row;
}

// What a CUDA graph of a fixed-shape Linear step (forward + backward, fp32 in and out) saves
// against launching its kernels one by one: at small M the kernels are short and the step is
// mostly launch cost. Both ways are timed by CUDA events on the stream (device time, gaps between
// kernels included) and by the host's clock around the same iterations (what a caller waits,
// launches included), each after warm-up; the graph is captured once, after the eager warm-up
// made cuBLASLt's plans and workspace, and replayed.
struct GraphRow {
  int64_t tokens, hidden;
  int kernels;  // nodes in the captured graph
  double eager_ms, graph_ms, eager_host_ms, graph_host_ms;
};

double HostMs(cudaStream_t stream, int warmup, int iters, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  GRADWIRE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) fn();
  GRADWIRE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
             .count() /
         iters;
}

GraphRow BenchLinearGraph(int64_t tokens, int64_t h, int iters, cudaStream_t stream) {
  const LinearStep step(tokens, h, /*bf16_io=*/false, stream);
  auto eager = [&] {
    step.Fwd();
    step.Bwd();
  };
  GraphRow row{tokens, h, 0, 0, 0, 0, 0};
  row.eager_ms = TimeMs(stream, 3, iters, eager);
  row.eager_host_ms = HostMs(stream, 3, iters, eager);
  GRADWIRE_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  GRADWIRE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    eager();
  } catch (...) {
    (void)cudaStreamEndCapture(stream, &graph);  // leave the stream usable for the next case
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    throw;
  }
  GRADWIRE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  try {
    size_t nodes = 0;
    GRADWIRE_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    row.kernels = int(nodes);
    GRADWIRE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    auto replay = [&] { GRADWIRE_CUDA_CHECK(cudaGraphLaunch(exec, stream)); };
    row.graph_ms = TimeMs(stream, 3, iters, replay);
    row.graph_host_ms = HostMs(stream, 3, iters, replay);
  } catch (...) {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    (void)cudaGraphDestroy(graph);
    throw;
  }
  GRADWIRE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  GRADWIRE_CUDA_CHECK(cudaGraphDestroy(graph));
  return row;
}

StepRow BenchLayerNormMlp(int64_t tokens, int64_t h, int64_t ffn, int iters, cudaStream_t stream) {
  const int64_t M = tokens, H = h, F = ffn;
  Buf x(static_cast<size_t>(M * H) * 4), gamma(static_cast<size_t>(H) * 4),
      beta(static_cast<size_t>(H) * 4), mu(static_cast<size_t>(M) * 4),
      rstd(static_cast<size_t>(M) * 4), w1(static_cast<size_t>(F * H) * 4),
      w2(static_cast<size_t>(H * F) * 4), fc1_out(static_cast<size_t>(M * F) * 4),
      y(static_cast<size_t>(M * H) * 4), dy(static_cast<size_t>(M * H) * 4),
      d_act(static_cast<size_t>(M * F) * 4), d_ln(static_cast<size_t>(M * H) * 4),
      dx(static_cast<size_t>(M * H) * 4), dw1(static_cast<size_t>(F * H) * 4),
      dw2(static_cast<size_t>(H * F) * 4), db1(static_cast<size_t>(F) * 4),
      db2(static_cast<size_t>(H) * 4), dgamma(static_cast<size_t>(H) * 4),
      dbeta(static_cast<size_t>(H) * 4), b1(static_cast<size_t>(F) * 2),
      b2(static_cast<size_t>(H) * 2);
  GRADWIRE_CUDA_CHECK(cudaMemset(b1.p, 0x3c, static_cast<size_t>(F) * 2));  // bf16 biases ~0.01
  GRADWIRE_CUDA_CHECK(cudaMemset(b2.p, 0x3c, static_cast<size_t>(H) * 2));
  FillRandom(x.as<float>(), size_t(M * H), 6, 2.0f);
  FillRandom(gamma.as<float>(), size_t(H), 7, 0.1f);
  FillRandom(beta.as<float>(), size_t(H), 8, 0.1f);
  FillRandom(w1.as<float>(), size_t(F * H), 9, 0.05f);
  FillRandom(w2.as<float>(), size_t(H * F), 10, 0.05f);
  FillRandom(dy.as<float>(), size_t(M * H), 11, 0.01f);
  Fp8Dev lnq(M, H, Fp8Format::kE4M3), actq(M, F, Fp8Format::kE4M3), w1q(F, H, Fp8Format::kE4M3),
      w2q(H, F, Fp8Format::kE4M3), gq(M, H, Fp8Format::kE5M2), hq(M, F, Fp8Format::kE5M2);
  gwc::CastTranspose(w1.as<float>(), F, H, w1q.Out(true), stream);
  gwc::CastTranspose(w2.as<float>(), H, F, w2q.Out(true), stream);
  const gwc::Fp8Output ln_out = lnq.Out(true), act_out = actq.Out(true), g_out = gq.Out(true),
                       h_out = hq.Out(true);
  auto fwd = [&] {
    gwc::LayerNormForward(x.as<float>(), M, H, gamma.as<float>(), beta.as<float>(), 1e-5f, false,
                          nullptr, &ln_out, mu.as<float>(), rstd.as<float>(), stream);
    gwc::LtGemmArgs fc1 = Gemm(lnq.data.as<uint8_t>(), lnq, w1q.data.as<uint8_t>(), w1q, M, F, H,
                               fc1_out.as<float>(), false, gwc::GemmAccumulation::kFast, stream);
    fc1.epilogue = gwc::GemmEpilogue::kBias;
    fc1.bias = b1.as<uint16_t>();
    gwc::Fp8GemmLt(fc1);
    gwc::ActivationForward(Activation::kGelu, fc1_out.as<float>(), M, F, nullptr, &act_out, stream);
    gwc::LtGemmArgs fc2 = Gemm(actq.data.as<uint8_t>(), actq, w2q.data.as<uint8_t>(), w2q, M, H, F,
                               y.as<float>(), false, gwc::GemmAccumulation::kFast, stream);
    fc2.epilogue = gwc::GemmEpilogue::kBias;
    fc2.bias = b2.as<uint16_t>();
    gwc::Fp8GemmLt(fc2);
  };
  auto bwd = [&] {
    gwc::CastTransposeDbias(dy.as<float>(), M, H, g_out, db2.as<float>(), stream);
    gwc::Fp8GemmLt(Gemm(gq.data.as<uint8_t>(), gq, w2q.data_t.as<uint8_t>(), w2q, M, F, H,
                        d_act.as<float>(), false, gwc::GemmAccumulation::kSplit, stream));
    gwc::Fp8GemmLt(Gemm(gq.data_t.as<uint8_t>(), gq, actq.data_t.as<uint8_t>(), actq, H, F, M,
                        dw2.as<float>(), true, gwc::GemmAccumulation::kSplit, stream));
    gwc::DActivationDbiasCast(Activation::kGelu, d_act.as<float>(), fc1_out.as<float>(), M, F,
                              nullptr, &h_out, db1.as<float>(), stream);
    gwc::Fp8GemmLt(Gemm(hq.data.as<uint8_t>(), hq, w1q.data_t.as<uint8_t>(), w1q, M, H, F,
                        d_ln.as<float>(), false, gwc::GemmAccumulation::kSplit, stream));
    gwc::Fp8GemmLt(Gemm(hq.data_t.as<uint8_t>(), hq, lnq.data_t.as<uint8_t>(), lnq, F, H, M,
                        dw1.as<float>(), true, gwc::GemmAccumulation::kSplit, stream));
    gwc::LayerNormBackward(d_ln.as<float>(), x.as<float>(), mu.as<float>(), rstd.as<float>(),
                           gamma.as<float>(), M, H, false, dx.as<float>(), dgamma.as<float>(),
                           dbeta.as<float>(), stream);
  };
  StepRow row{"layernorm_mlp", tokens, h, ffn, 0, 0, 0};
  row.fwd_ms = TimeMs(stream, 2, iters, fwd);
  fwd();
  row.bwd_ms = TimeMs(stream, 2, iters, bwd);
  row.step_ms = TimeMs(stream, 2, iters, [&] {
    fwd();
    bwd();
  });
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  int iters = 20;
  bool quick = false;
  std::vector<Mnk> shapes;  // --shapes; empty: the default set below
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (arg == "--iters" && i + 1 < argc) {
      iters = std::stoi(argv[++i]);
    } else if (arg == "--quick") {
      quick = true;  // small shapes: a smoke run of the whole program
    } else if (arg == "--shapes" && i + 1 < argc) {
      if (!ParseShapes(argv[++i], &shapes)) {
        std::fprintf(stderr,
                     "%s: --shapes takes MxNxK[,MxNxK...], each a positive multiple of 16\n",
                     argv[0]);
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--json PATH] [--iters N] [--quick] [--shapes MxNxK,...]\n",
                   argv[0]);
      return 2;
    }
  }
  std::string why;
  if (gwc::DeviceCount(&why) == 0) {
    std::fprintf(stderr, "gradwire-cuda-bench: no CUDA device (%s)\n", why.c_str());
    return 1;
  }
  try {
    const std::string device = gwc::DeviceDescription(0);
    cudaStream_t stream;
    GRADWIRE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // --quick divides the default sizes by 8; shapes given with --shapes run as given (a small
    // M such as 16 divided by 8 would no longer be a multiple of 16).
    const int64_t s = quick ? 8 : 1;
    if (shapes.empty()) {
      for (const Mnk& d : std::vector<Mnk>{
               {4096, 4096, 4096}, {8192, 8192, 8192}, {16384, 4096, 4096}, {16384, 16384, 4096}}) {
        shapes.push_back({d.m / s, d.n / s, d.k / s});
      }
    }
    std::vector<GemmRow> gemms;
    // A case that fails is reported and left out; the others still run.
    int failures = 0;
    auto attempt = [&](const char* what, const std::function<void()>& fn) {
      try {
        fn();
      } catch (const std::exception& e) {
        ++failures;
        std::fprintf(stderr, "gradwire-cuda-bench: %s failed: %s\n", what, e.what());
        cudaGetLastError();  // clear a sticky launch error so later cases report their own
      }
    };
    for (const Mnk& shape : shapes) {
      attempt("gemm",
              [&] { gemms.push_back(BenchGemm(shape.m, shape.n, shape.k, iters, stream)); });
    }
    std::vector<StepRow> steps;
    attempt("linear", [&] {
      steps.push_back(BenchLinear(16384 / s, 4096 / s, /*bf16_io=*/false, iters, stream));
    });
    attempt("linear_bf16", [&] {
      steps.push_back(BenchLinear(16384 / s, 4096 / s, /*bf16_io=*/true, iters, stream));
    });
    attempt("layernorm_mlp", [&] {
      steps.push_back(BenchLayerNormMlp(16384 / s, 4096 / s, 16384 / s, iters, stream));
    });
    // The small M that remote clients send (--quick: hidden 512, so the graph's saving shows too).
    std::vector<GraphRow> graphs;
    for (int64_t m : {16, 256, 2048}) {
      attempt("linear_graph",
              [&] { graphs.push_back(BenchLinearGraph(m, 4096 / s, iters, stream)); });
    }

    std::printf("device: %s\n\n", device.c_str());
    std::printf("%-8s %-8s %-8s %10s %10s\n", "M", "N", "K", "ms", "TFLOP/s");
    for (const GemmRow& g : gemms) {
      std::printf("%-8lld %-8lld %-8lld %10.3f %10.1f\n", (long long)g.m, (long long)g.n,
                  (long long)g.k, g.ms, g.tflops);
    }
    std::printf("\n%-14s %-8s %-8s %-8s %10s %10s %10s\n", "module", "tokens", "hidden", "ffn",
                "fwd ms", "bwd ms", "step ms");
    for (const StepRow& r : steps) {
      std::printf("%-14s %-8lld %-8lld %-8lld %10.3f %10.3f %10.3f\n", r.name.c_str(),
                  (long long)r.tokens, (long long)r.hidden, (long long)r.ffn, r.fwd_ms, r.bwd_ms,
                  r.step_ms);
    }
    std::printf(
        "\nLinear step (fwd + bwd, fp32 in/out): kernels launched one by one vs one CUDA "
        "graph\n%-8s %-8s %-7s %12s %12s %14s %14s\n",
        "tokens", "hidden", "nodes", "eager ms", "graph ms", "eager host ms", "graph host ms");
    for (const GraphRow& g : graphs) {
      std::printf("%-8lld %-8lld %-7d %12.4f %12.4f %14.4f %14.4f\n", (long long)g.tokens,
                  (long long)g.hidden, g.kernels, g.eager_ms, g.graph_ms, g.eager_host_ms,
                  g.graph_host_ms);
    }
    if (!json_path.empty()) {
      FILE* f = std::fopen(json_path.c_str(), "w");
      if (!f) {
        std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
        return 1;
      }
      std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"iters\": %d,\n  \"gemm\": [\n", device.c_str(),
                   iters);
      for (size_t i = 0; i < gemms.size(); ++i) {
        const GemmRow& g = gemms[i];
        std::fprintf(
            f, "    {\"m\": %lld, \"n\": %lld, \"k\": %lld, \"ms\": %.6f, \"tflops\": %.3f}%s\n",
            (long long)g.m, (long long)g.n, (long long)g.k, g.ms, g.tflops,
            i + 1 < gemms.size() ? "," : "");
      }
      std::fprintf(f, "  ],\n  \"modules\": [\n");
      for (size_t i = 0; i < steps.size(); ++i) {
        const StepRow& r = steps[i];
        std::fprintf(f,
                     "    {\"name\": \"%s\", \"tokens\": %lld, \"hidden\": %lld, \"ffn\": %lld, "
                     "\"fwd_ms\": %.6f, \"bwd_ms\": %.6f, \"step_ms\": %.6f}%s\n",
                     r.name.c_str(), (long long)r.tokens, (long long)r.hidden, (long long)r.ffn,
                     r.fwd_ms, r.bwd_ms, r.step_ms, i + 1 < steps.size() ? "," : "");
      }
      std::fprintf(f, "  ],\n  \"graphs\": [\n");
      for (size_t i = 0; i < graphs.size(); ++i) {
        const GraphRow& g = graphs[i];
        std::fprintf(f,
                     "    {\"name\": \"linear_step\", \"tokens\": %lld, \"hidden\": %lld, "
                     "\"nodes\": %d, \"eager_ms\": %.6f, \"graph_ms\": %.6f, "
                     "\"eager_host_ms\": %.6f, \"graph_host_ms\": %.6f}%s\n",
                     (long long)g.tokens, (long long)g.hidden, g.kernels, g.eager_ms, g.graph_ms,
                     g.eager_host_ms, g.graph_host_ms, i + 1 < graphs.size() ? "," : "");
      }
      std::fprintf(f, "  ]\n}\n");
      std::fclose(f);
    }
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gradwire-cuda-bench: %s\n", e.what());
    return 1;
  }
}
