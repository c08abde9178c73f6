// The CPU backend's FP8 GEMM (kernels/cpu/ordered_gemm.h) next to OpenBLAS sgemm, side by side in
// one run, for the three products of a Linear layer with in = out = D at M rows:
//   fprop  Y[M, D]  = X[M, D] . W^T      GEMM m = M, n = D, k = D  (W's panels prepacked)
//   dgrad  dX[M, D] = dY[M, D] . W       GEMM m = M, n = D, k = D  (W^T's panels prepacked)
//   wgrad  dW[D, D] += dY^T . X          GEMM m = D, n = D, k = M  (X^T packed per call)
// The FP8 side is timed as the CPU backend runs it: from FP8 codes, with the decode of A (as it is
// packed) and, for wgrad, the packing of B inside the time; a weight's panels are built once per
// weight version, outside it. sgemm gets ready fp32 operands (what an fp32 layer hands it), on the
// same threads: split by the pool over blocks of C (BLAS single-threaded, the backend's default)
// and by BLAS's own threads, and the faster of the two counts.
//
// --copies times the FP8 side on each named copy of the micro-kernel (kernels/cpu/ordered_gemm.h)
// in the same run, each against the same sgemm; the first one is the row's fp8 figure.
//
//   gemm_bench [--m 1,16,256,4096] [--d 1024,4096] [--seconds 0.3] [--copies best|all|NAME,...]
//              [--json PATH]
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gradwire/kernels/cpu/blas.h"
#include "gradwire/kernels/cpu/loops.h"
#include "gradwire/kernels/cpu/ordered_gemm.h"
#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/cast.h"

namespace cpu = gradwire::kernels::cpu;
using gradwire::kernels::Fp8Format;

namespace {

std::vector<int64_t> ParseList(const char* text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoll(item));
  return out;
}

// Random values cast to FP8 codes at their own scale; *scale_inv decodes them.
std::vector<uint8_t> Codes(int64_t n, Fp8Format format, float* scale_inv) {
  static std::mt19937 rng(12345);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = dist(rng);
  const float scale =
      gradwire::kernels::ComputeScale(gradwire::kernels::Amax(x.data(), n), format, 0);
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  gradwire::kernels::QuantizeFp8(x.data(), 1, n, scale, format, codes.data(), nullptr, nullptr);
  *scale_inv = 1.0f / scale;
  return codes;
}

std::vector<float> Decoded(const std::vector<uint8_t>& codes, Fp8Format format) {
  std::vector<float> out(codes.size());
  cpu::DecodeCodes(codes.data(), int64_t(codes.size()), format, out.data());
  return out;
}

// Seconds per call: the fastest of repeated calls, run for at least `budget` seconds and twice.
double Time(const std::function<void()>& call, double budget) {
  call();  // warm-up: caches, scratch, page faults
  double best = 1e30, spent = 0;
  for (int i = 0; spent < budget || i < 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
    spent += s;
  }
  return best;
}

struct Row {
  std::string product;
  int64_t m_rows, d, gemm_m, gemm_n, gemm_k;
  double fp8_s, blas_pool_s, blas_own_s;
  std::vector<double> copy_s;  // per copy of --copies; fp8_s is the first
};

std::vector<cpu::OrderedGemmCopy> ParseCopies(const std::string& text) {
  std::vector<cpu::OrderedGemmCopy> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item == "best") {
      out.push_back(cpu::OrderedGemmBestCopy());
      continue;
    }
    if (item == "all") {  // every copy this CPU runs, widest first
      for (cpu::OrderedGemmCopy c :
           {cpu::OrderedGemmCopy::kAvx512Bf16, cpu::OrderedGemmCopy::kAvx512,
            cpu::OrderedGemmCopy::kAvx2, cpu::OrderedGemmCopy::kBaseline}) {
        if (cpu::OrderedGemmCopySupported(c)) out.push_back(c);
      }
      continue;
    }
    const auto copy = cpu::OrderedGemmCopyByName(item);
    if (!copy || !cpu::OrderedGemmCopySupported(*copy)) {
      std::fprintf(stderr, "gemm_bench: no copy %s on this build or CPU (best: %s)\n", item.c_str(),
                   cpu::OrderedGemmCopyName(cpu::OrderedGemmBestCopy()));
      std::exit(2);
    }
    out.push_back(*copy);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> ms = {1, 16, 256, 4096}, ds = {1024, 4096};
  double budget = 0.3;
  std::string json_path;
  std::string copies_text = "best";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "gemm_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--m") {
      ms = ParseList(value());
    } else if (a == "--d") {
      ds = ParseList(value());
    } else if (a == "--seconds") {
      budget = std::stod(value());
    } else if (a == "--json") {
      json_path = value();
    } else if (a == "--copies") {
      copies_text = value();
    } else if (a == "--list-copies") {  // the copies this CPU runs, widest first, one a line
      for (cpu::OrderedGemmCopy c : ParseCopies("all"))
        std::printf("%s\n", cpu::OrderedGemmCopyName(c));
      return 0;
    } else {
      std::fprintf(stderr,
                   "usage: gemm_bench [--m 1,16,256,4096] [--d 1024,4096] [--seconds 0.3] "
                   "[--copies best|all|avx512bf16,avx512,avx2,baseline] [--json PATH]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  // The BLAS the server gets through libtorch: Debian's libblas.so.3 alternative (OpenBLAS).
  for (const char* lib : {"libopenblas.so.0", "libblas.so.3"}) {
    if (dlopen(lib, RTLD_NOW | RTLD_GLOBAL) != nullptr) break;
  }
  if (!cpu::BlasAvailable()) {
    std::fprintf(stderr, "gemm_bench: no BLAS sgemm found (libopenblas0-pthread)\n");
    return 1;
  }
  cpu::SetThreads(0);
  const std::vector<cpu::OrderedGemmCopy> copies = ParseCopies(copies_text);
  const std::string copy = cpu::OrderedGemmCopyName(copies.front());
  std::printf("FP8 GEMM (%s micro-kernel) against %s, %d threads\n", copy.c_str(),
              cpu::BlasDescription().c_str(), cpu::Threads());
  std::printf("%-6s %5s %5s | %10s %10s %10s | %9s %9s | %7s", "prod", "M", "D", "fp8 ms",
              "blas ms", "blas-own", "fp8 GF/s", "blas GF/s", "ratio");
  for (size_t c = 1; c < copies.size(); ++c) {
    std::printf(" | %10s", (std::string(cpu::OrderedGemmCopyName(copies[c])) + " x").c_str());
  }
  std::printf("\n");
  std::vector<Row> rows;
  for (int64_t d : ds) {
    float s_w = 1, s_x = 1, s_dy = 1;
    const std::vector<uint8_t> w_codes = Codes(d * d, Fp8Format::kE4M3, &s_w);  // W [D, D]
    const std::vector<float> w = Decoded(w_codes, Fp8Format::kE4M3);
    // The workspace's panels: W's rows for fprop; W^T's (W read [k, n]) for dgrad.
    const cpu::GemmPanels fprop_panels(w_codes.data(), Fp8Format::kE4M3, d, d, true);
    const cpu::GemmPanels dgrad_panels(w_codes.data(), Fp8Format::kE4M3, d, d, false);
    for (int64_t m : ms) {
      const std::vector<uint8_t> x_codes = Codes(m * d, Fp8Format::kE4M3, &s_x);
      const std::vector<uint8_t> dy_codes = Codes(m * d, Fp8Format::kE5M2, &s_dy);
      const std::vector<float> x = Decoded(x_codes, Fp8Format::kE4M3);
      const std::vector<float> dy = Decoded(dy_codes, Fp8Format::kE5M2);
      // Columnwise copies (what a saved context keeps for wgrad): X^T [D, M], dY^T [D, M].
      std::vector<uint8_t> xt_codes(size_t(m * d)), dyt_codes(size_t(m * d));
      gradwire::kernels::TransposeCodes(x_codes.data(), m, d, xt_codes.data());
      gradwire::kernels::TransposeCodes(dy_codes.data(), m, d, dyt_codes.data());
      std::vector<float> out(size_t(std::max(m * d, d * d)));
      std::vector<uint16_t> b_scratch(cpu::PanelBytes(d, m) / sizeof(uint16_t));

      auto fp8 = [&](const std::string& product) {
        return [&, product]() {
          cpu::OrderedGemmArgs g;
          g.c = out.data();
          if (product == "wgrad") {
            cpu::PackPanelsFromCodes(xt_codes.data(), Fp8Format::kE4M3, d, m, true,
                                     b_scratch.data());
            g.m = d;
            g.a_codes = dyt_codes.data();
            g.a_format = Fp8Format::kE5M2;
            g.lda = m;
            g.b = {d, m, b_scratch.data()};
            g.scale = s_dy * s_x;
            g.accumulate = true;
            g.ldc = d;
          } else {
            const bool f = product == "fprop";
            g.m = m;
            g.a_codes = f ? x_codes.data() : dy_codes.data();
            g.a_format = f ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
            g.lda = d;
            g.b = f ? fprop_panels.view() : dgrad_panels.view();
            g.scale = (f ? s_x : s_dy) * s_w;
            g.ldc = d;
          }
          cpu::OrderedGemm(g);
        };
      };
      // sgemm on the decoded fp32 operands, blocks of C split over the pool (BLAS single-threaded)
      // or one call on BLAS's own threads.
      auto blas = [&](const std::string& product) {
        return [&, product]() {
          if (product == "fprop") {
            cpu::Sgemm(false, true, m, d, d, s_x * s_w, x.data(), d, w.data(), d, 0.0f, out.data(),
                       d);
          } else if (product == "dgrad") {
            cpu::Sgemm(false, false, m, d, d, s_dy * s_w, dy.data(), d, w.data(), d, 0.0f,
                       out.data(), d);
          } else {
            cpu::Sgemm(true, false, d, d, m, s_dy * s_x, dy.data(), d, x.data(), d, 1.0f,
                       out.data(), d);
          }
        };
      };
      for (const std::string product : {"fprop", "dgrad", "wgrad"}) {
        Row r{product, m, d, product == "wgrad" ? d : m, d, product == "wgrad" ? m : d, 0, 0, 0};
        // A product this size runs few times; keep the budget but never less than two calls.
        for (cpu::OrderedGemmCopy c : copies) {
          cpu::SetOrderedGemmCopy(c);
          r.copy_s.push_back(Time(fp8(product), budget));
        }
        cpu::SetOrderedGemmCopy(std::nullopt);
        r.fp8_s = r.copy_s.front();
        cpu::SetGemmThreads(cpu::GemmThreads::kPool);
        r.blas_pool_s = Time(blas(product), budget);
        cpu::SetGemmThreads(cpu::GemmThreads::kBlas);
        r.blas_own_s = Time(blas(product), budget);
        cpu::SetGemmThreads(cpu::GemmThreads::kPool);
        const double flops = 2.0 * double(r.gemm_m) * double(r.gemm_n) * double(r.gemm_k);
        const double blas_s = std::min(r.blas_pool_s, r.blas_own_s);
        std::printf("%-6s %5lld %5lld | %10.4f %10.4f %10.4f | %9.1f %9.1f | %6.2fx",
                    product.c_str(), (long long)m, (long long)d, r.fp8_s * 1e3, r.blas_pool_s * 1e3,
                    r.blas_own_s * 1e3, flops / r.fp8_s * 1e-9, flops / blas_s * 1e-9,
                    blas_s / r.fp8_s);
        for (size_t c = 1; c < copies.size(); ++c) std::printf(" | %9.2fx", blas_s / r.copy_s[c]);
        std::printf("\n");
        std::fflush(stdout);
        rows.push_back(r);
      }
    }
  }
  if (!json_path.empty()) {
    std::ofstream js(json_path);
    js << "{\n  \"micro_kernel\": \"" << copy << "\",\n  \"threads\": " << cpu::Threads()
       << ",\n  \"blas\": \"" << cpu::BlasDescription() << "\",\n  \"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const double flops = 2.0 * double(r.gemm_m) * double(r.gemm_n) * double(r.gemm_k);
      const double blas_s = std::min(r.blas_pool_s, r.blas_own_s);
      js << "    {\"product\": \"" << r.product << "\", \"rows\": " << r.m_rows
         << ", \"in\": " << r.d << ", \"out\": " << r.d << ", \"gemm_m\": " << r.gemm_m
         << ", \"gemm_n\": " << r.gemm_n << ", \"gemm_k\": " << r.gemm_k
         << ", \"fp8_ms\": " << r.fp8_s * 1e3 << ", \"sgemm_pool_ms\": " << r.blas_pool_s * 1e3
         << ", \"sgemm_own_threads_ms\": " << r.blas_own_s * 1e3
         << ", \"fp8_gflops\": " << flops / r.fp8_s * 1e-9
         << ", \"sgemm_gflops\": " << flops / blas_s * 1e-9
         << ", \"fp8_speedup_vs_sgemm\": " << blas_s / r.fp8_s << ", \"copies_ms\": {";
      for (size_t c = 0; c < copies.size(); ++c) {
        js << (c > 0 ? ", " : "") << "\"" << cpu::OrderedGemmCopyName(copies[c])
           << "\": " << r.copy_s[c] * 1e3;
      }
      js << "}}" << (i + 1 < rows.size() ? ",\n" : "\n");
    }
    js << "  ]\n}\n";
  }
  return 0;
}
