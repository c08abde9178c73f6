// The device seam of the core: every computation a module makes goes through one Backend, at the
// granularity of the fused FP8 kernels (a cast writes rowwise codes, transposed codes, amax and
// scale_inv in one pass; a GEMM takes FP8 operands and their scale_inv). The modules
// (linear.cc, layernorm_linear.cc, layernorm_mlp.cc) are written once against it.
//
//   ReferenceBackend  kernels/ref, single-threaded: the definition of the numerics
//   CpuBackend        kernels/ref casts, GEMMs on BLAS, multi-threaded (cpu_backend.cc)
//   CudaBackend       kernels/cuda + cuBLASLt on one GPU (cuda/, GRADWIRE_CUDA builds)
//
// Tensors a backend takes and returns live on its device (device()), fp32 unless named
// otherwise, contiguous and 2-D ([rows, cols]). Host tensors cross with ToDevice/ToHost. Every
// call is ordered after the previous one on the backend's stream; results are ready for the next
// call of the same backend. Host values come back when the host asks for them: a cast's scale,
// scale_inv and amax (Fp8Tensor::scalars) when first read, waiting then for the cast if need be.
// docs/backends.md describes the seam, what each backend does, and what is not in it yet.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/kernels/activation.h"
#include "gradwire/wire/codec.h"
#include "server/device/fp8_tensor.h"
#include "server/device/ops.h"
#include "server/device/quantizer.h"
#include "server/device/scaling_state.h"

namespace gradwire::device {

struct LayerNormParams {
  at::Tensor gamma;  // float32 [K]
  at::Tensor beta;   // float32 [K]
  float eps = 1e-5f;
  bool zero_centered_gamma = false;  // the scale is 1 + gamma
};

// LayerNorm forward results: y [M, K], mu [M], rstd [M].
struct LayerNormOut {
  at::Tensor y, mu, rstd;
};

// The FP8 scaling state of a module's roles on a backend's device (DeviceScaling owns one): for n
// roles, history fp32 [n, history_len] (most recent first; entries not yet filled are 0, which
// never changes a max of amaxes), scale and scale_inv fp32 [n].
struct ScalingTensors {
  at::Tensor history, scale, scale_inv;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu", "cuda" (what --device names and GetServerInfo reports) or "reference".
  virtual const char* name() const = 0;
  // The ATen device of the tensors this backend computes on.
  virtual at::Device device() const = 0;
  // One line for logs: the device and what computes on it.
  virtual std::string Describe() const = 0;
  // True when AccumulateBiasGrad sums each column in float32 in row order from 0, then adds the
  // sum (the CPU and reference backends): a client can then make a bias gradient bit for bit
  // (BackwardRequest.grad_output_column_sums, ModuleInfo.row_order_bias_sums).
  virtual bool SumsColumnsInRowOrder() const { return false; }

  // True when this backend runs `op` its own way; false when it runs Backend's default for it
  // (ops.h: the ops with has_default). Every backend runs every op, so an op without a default is
  // always supported. A backend that overrides a defaulted op says so here, and the parity
  // harness holds each such op to its contract against the default or the reference.
  virtual bool Supports(Op op) const;

  // A contiguous copy of `t` (any device) on this backend's device; on the CPU backend `t`
  // itself when it is already a contiguous CPU tensor.
  virtual at::Tensor ToDevice(const at::Tensor& t) const = 0;
  // `t` on the host (contiguous); on the CPU backend `t` itself.
  virtual at::Tensor ToHost(const at::Tensor& t) const = 0;
  // Uninitialised / zeroed fp32 tensors on the device.
  at::Tensor Empty(at::IntArrayRef shape) const;
  at::Tensor Zeros(at::IntArrayRef shape) const;

  // Casts x (fp32 [rows, cols]) to FP8 under `config` (delayed: config.scale; current: from
  // x's amax with config.margin), writing the copies `usage` asks for. The result's amax is
  // x's amax whatever the recipe. x may also be bfloat16 (FromWireBf16): the cast is then that
  // of its exact fp32 widening, bit for bit.
  virtual absl::StatusOr<Fp8Tensor> Cast(const at::Tensor& x, const QuantizerConfig& config,
                                         CastUsage usage) const = 0;
  // An FP8 tensor from host codes that arrived already cast (rows x cols, row-major) with their
  // scale_inv; the columnwise copy is the exact transpose, amax the largest |decoded value|.
  virtual Fp8Tensor FromCodes(const uint8_t* host_codes, int64_t rows, int64_t cols,
                              kernels::Fp8Format format, float scale_inv,
                              CastUsage usage) const = 0;
  // Narrow wire tensors in and out of the device: the rpc layer hands over views of the bytes as
  // they arrived, and nothing is widened on the host first (an FP8 tensor reaches a GPU as one
  // byte per element, bf16 as two).
  //
  // Decodes `v` as fp32 [rows, cols] (rows * cols == v.numel()) on this device; may borrow v's
  // bytes on the host backends (keep them alive while the result is used). For an FP8 view,
  // `codes` (when not null) also receives its codes as they came, with the copies `usage` asks
  // for, so a module can use them without re-quantizing.
  // A block-scaled view's codes are FromBlockCodes' (only the copies that arrived).
  virtual at::Tensor FromWire(const wire::TensorView& v, int64_t rows, int64_t cols,
                              Fp8Tensor* codes, CastUsage usage) const = 0;
  // x as float32 on this device: x itself when it is float32, a bfloat16 x widened (exactly).
  // The default is libtorch's conversion; the CPU backend's is threaded.
  virtual at::Tensor Widen(const at::Tensor& x) const;
  // x (fp32 on this device) rounded to bfloat16, to nearest even as the wire codec rounds. The
  // default is libtorch's conversion; the host backends use the wire codec's.
  virtual at::Tensor NarrowBf16(const at::Tensor& x) const;
  // A bf16 view (v.dtype kBF16) as it arrived: bfloat16 [rows, cols] on this device, not widened
  // (2 bytes per element cross to a GPU), for a kind that UsesBf16Input (its casts read bf16).
  // The default takes the host bytes (borrowed when aligned, as FromWire may) and ToDevice.
  virtual at::Tensor FromWireBf16(const wire::TensorView& v, int64_t rows, int64_t cols) const;
  // Encodes x (fp32 on this device) as `dtype` into host bytes, rounding as the wire codec does;
  // FP8 takes a scale from x's own amax (current scaling, margin 0). A bfloat16 x (FpropBf16's)
  // encodes as its widening would, so as BF16 its bytes go as they are. `shape` is what the
  // encoded tensor reports (x's element count).
  virtual wire::EncodedTensor ToWire(const at::Tensor& x, wire::DType dtype,
                                     std::vector<int64_t> shape) const = 0;
  // ToWire, except that FP8 under block scaling (scaling.block > 0) is encoded on the host with
  // a power-of-two scale per 1 x block run of each row (wire::Encode), as the BLOCK and MXFP8
  // recipes' FP8 outputs and gradients go.
  wire::EncodedTensor ToWireScaled(const at::Tensor& x, wire::DType dtype,
                                   std::vector<int64_t> shape, wire::Fp8Scaling scaling) const;

  // Decodes one stored copy back to fp32 (rowwise: [rows, cols]; else [cols, rows]).
  virtual at::Tensor Dequantize(const Fp8Tensor& t, bool rowwise) const = 0;
  // Called once on each weight of a new workspace (per weight version): a backend may attach
  // what its GEMMs read per call (the CPU backend's packed panels).
  virtual void PrepareWeight(Fp8Tensor& w) const { (void)w; }

  // x may be bfloat16 in these and in LayerNormCast (a LayerNorm kind's bf16 input, kept as it
  // came): the results are then those of its exact fp32 widening, bit for bit; a GPU reads the
  // bf16 values in its kernels, with no widened copy.
  virtual LayerNormOut LayerNormForward(const at::Tensor& x, const LayerNormParams& ln) const = 0;
  // Returns dx and accumulates into gamma_grad / beta_grad.
  virtual at::Tensor LayerNormBackward(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& mu, const at::Tensor& rstd,
                                       const LayerNormParams& ln, at::Tensor& gamma_grad,
                                       at::Tensor& beta_grad) const = 0;

  // in: [M, (gated ? 2 : 1) * width] -> act(in): [M, width].
  virtual at::Tensor ActivationForward(kernels::Activation act, const at::Tensor& in,
                                       int64_t width) const = 0;
  // d act(in) given dout [M, width]: [M, (gated ? 2 : 1) * width].
  virtual at::Tensor ActivationBackward(kernels::Activation act, const at::Tensor& dout,
                                        const at::Tensor& in, int64_t width) const = 0;

  // Fused forms: an op and the FP8 cast of its result, which a backend may run as one kernel that
  // never writes the fp32 result it does not need (docs/backends.md, "Fused forms"). Each has a
  // composed default (the op, then Cast): a backend's fused form gives that default's results bit
  // for bit (the parity harness's LayerNormCast, ActivationCast and DActivationCast rows), so
  // modules call the fused forms everywhere and a batch's per-request casts (CastRows, which
  // composes) match them. The config casts one tensor (its row_groups are not read here;
  // fp8_ops.h's *Rows helpers split them).
  //
  // Cast of LayerNormForward(x, ln).y; `ln_out` receives mu and rstd, and y only when keep_y.
  virtual absl::StatusOr<Fp8Tensor> LayerNormCast(const at::Tensor& x, const LayerNormParams& ln,
                                                  const QuantizerConfig& config, CastUsage usage,
                                                  bool keep_y, LayerNormOut* ln_out) const;
  // Cast of ActivationForward(act, in, width); `y` (when not null) receives the activation.
  virtual absl::StatusOr<Fp8Tensor> ActivationCast(kernels::Activation act, const at::Tensor& in,
                                                   int64_t width, const QuantizerConfig& config,
                                                   CastUsage usage, at::Tensor* y) const;
  // Cast of ActivationBackward(act, dout, in, width); `din` (when not null) receives it.
  virtual absl::StatusOr<Fp8Tensor> DActivationCast(kernels::Activation act, const at::Tensor& dout,
                                                    const at::Tensor& in, int64_t width,
                                                    const QuantizerConfig& config, CastUsage usage,
                                                    at::Tensor* din) const;

  // The three FP8 GEMMs of a linear layer, fp32 accumulation and output:
  //   Fprop  y[M, N] = x[M, K] . w[N, K]^T (+ bias[N]), x and w rowwise, fast accumulation
  //   Dgrad  dx[M, K] = dy[M, N] . w[N, K], dy rowwise, w columnwise, split accumulation
  //   Wgrad  acc[N, K] = (accumulate ? acc : 0) + dy^T . x, dy and x columnwise, split
  //          accumulation
  virtual at::Tensor Fprop(const Fp8Tensor& x, const Fp8Tensor& w,
                           const at::Tensor& bias) const = 0;
  virtual at::Tensor Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) const = 0;
  virtual void Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc,
                     bool accumulate) const = 0;
  // Fprop and Dgrad into a destination the caller has ready (float32, contiguous, on this
  // backend's device, of the output's shape): a response's bytes, which the GEMM then writes
  // once, with no output of its own to copy from. The bits are Fprop's and Dgrad's. The
  // defaults copy their results there; a backend whose GEMMs write in place says so
  // (GemmsWriteInPlace), and only then does the step runner lend them a response's bytes.
  virtual void FpropInto(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias,
                         at::Tensor& y) const;
  virtual void DgradInto(const Fp8Tensor& dy, const Fp8Tensor& w, at::Tensor& dx) const;
  virtual bool GemmsWriteInPlace() const { return false; }
  // Fprop with its output in bfloat16 (what a bf16 response carries): NarrowBf16 of Fprop's
  // output, bit for bit. The default is exactly that, and every backend keeps it: a GEMM that
  // writes bf16 itself (cuBLASLt D in bf16) may pick another algorithm than the fp32 one, and a
  // request's bits would then depend on whether it ran alone or in a batch.
  virtual at::Tensor FpropBf16(const Fp8Tensor& x, const Fp8Tensor& w,
                               const at::Tensor& bias) const;
  // Fprop of a row-grouped x (a batch: Fp8Tensor::groups, each part with its own scale_inv):
  // every output row bit for bit what Fprop of its group alone gives. The default runs one Fprop
  // per group, which is that by construction; a backend whose GEMM is row-invariant runs one GEMM
  // over all the rows, applying each group's scale_inv to its rows (docs/batching.md).
  virtual at::Tensor FpropGroups(const Fp8Tensor& x, const Fp8Tensor& w,
                                 const at::Tensor& bias) const;
  // Dgrad of a row-grouped dy (a batch of backwards, each group cast on its own): every row of
  // dx bit for bit what Dgrad of its group alone gives. The default runs one Dgrad per group; a
  // backend whose dgrad GEMM is row-invariant runs one GEMM with a scale per row group.
  virtual at::Tensor DgradGroups(const Fp8Tensor& dy, const Fp8Tensor& w) const;
  // acc[N] += column sums of g[M, N] (unquantized; fp32, or bf16 summed as its exact widening).
  virtual void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) const = 0;

  // Ends one step of the delayed-scaling recipe for `roles` (distinct indices into s, all of
  // `format`), role roles[i] having measured amaxes[i]: for each, bit for bit
  // ScalingState::Record(amax) then Roll() (scaling_state.h), on the device; scale_inv = 1 / scale.
  // Nothing comes back to the host. The default runs ScalingState on the host (the host
  // backends' tensors are host tensors; others' are copied out and back, synchronously); the
  // CUDA backend runs cuda::DelayedScalingRoll on its stream.
  virtual void RollScaling(ScalingTensors& s, const std::vector<int64_t>& roles,
                           const std::vector<float>& amaxes, kernels::Fp8Format format,
                           const RecipeConfig& config) const;

  // The finite checks ride on these: each returns, with its result, the largest |value| it saw
  // (NaN when any value is NaN), on the host.
  // max |x| of an fp32 tensor.
  virtual float AbsMax(const at::Tensor& x) const = 0;
  // out = a + b (same shape; out may be a or b); returns max |out|.
  virtual float AddAbsMax(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) const = 0;
  // AbsMax(x), as the amax() of the CastScalars returned, read when first asked for. The default
  // computes it now (the host backends); a GPU queues the reduction and its copy back, so that a
  // read after the call's result has crossed to the host costs no wait of its own.
  virtual CastScalars AbsMaxLater(const at::Tensor& x) const;

  // Waits until everything queued on the backend's stream has run.
  virtual void Synchronize() const = 0;
  // How many times so far the host has waited for this backend's device to compute something:
  // stream synchronisations it made to read back a result (a cast's scalars, a finite check, an
  // output's bytes in ToWire) or in Synchronize. Copies of inputs to the device are not counted.
  // 0 on the host backends, whose calls return finished.
  virtual int64_t HostWaits() const { return 0; }
};

using BackendPtr = std::shared_ptr<const Backend>;

// The reference backend: the oracle of the parity tests.
BackendPtr MakeReferenceBackend();

// The CPU backend (always available): what --device cpu runs and the default everywhere.
BackendPtr MakeCpuBackend();
// The threads the CPU backend runs on (kernels/cpu/parallel.h; 0: one per core), and who splits
// its GEMMs: by default the same threads, BLAS called single-threaded on blocks of the output;
// with gemm_on_blas_threads, BLAS's own threads (which then compete with the pool for the cores).
// gradwire-server sets them from --cpu-threads and --cpu-gemm-threads at start.
void SetCpuThreads(int threads, bool gemm_on_blas_threads = false);

// The CUDA backend on GPU `device`, or why it cannot run here: UNAVAILABLE when this build has
// no CUDA backend (GRADWIRE_CUDA off), libtorch has no CUDA, or no usable GPU is present.
absl::StatusOr<BackendPtr> MakeCudaBackend(int device = 0);

// True when this build compiled the CUDA backend in.
bool CudaBackendBuilt();

// Pinned staging for the CUDA backend's wire crossings (server/device/staged_copy.h): the chunk
// size in bytes of its two pinned slots, 0 for plain pageable copies. A CUDA backend reads it when
// it is made. gradwire-server, gradwire-load and step_breakdown always set it from their
// --cuda-staging-mib; elsewhere (the test binaries) GRADWIRE_CUDA_STAGING_MIB (MiB, at most 1024)
// gives it until it is set, else 0.
void SetCudaStaging(int64_t chunk_bytes);
int64_t CudaStaging();

// FromWire of a block-scaled FP8 view (v.blocks present) on the host: its decoded values as fp32
// [rows, cols], and in `codes` (when not null) its codes as they came (FromBlockCodes).
at::Tensor HostFromBlockScaledWire(const wire::TensorView& v, int64_t rows, int64_t cols,
                                   Fp8Tensor* codes, CastUsage usage);

}  // namespace gradwire::device
