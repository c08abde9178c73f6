// The wire's element codec, one for the server and the C++ client: the element types a tensor
// may travel as, their sizes, and the conversions between them and float32. Torch-free and
// protobuf-free (gradwire/wire/tensor.h maps it onto gradwire.v1.Tensor); the element math is
// the reference kernels', so every side rounds alike.
//
// Byte order is little-endian. Encoded bytes may sit at any address: protobuf and chunk buffers
// guarantee no alignment, so the decoders read them as bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gradwire::wire {

enum class DType : uint8_t { kF32, kBF16, kF16, kFp8E4M3, kFp8E5M2 };

// Bytes of one element.
int64_t ElementSize(DType dtype);
const char* DTypeName(DType dtype);  // "F32", "BF16", "F16", "FP8_E4M3", "FP8_E5M2"
inline bool IsFp8(DType dtype) { return dtype == DType::kFp8E4M3 || dtype == DType::kFp8E5M2; }

// The block scales of an FP8 tensor (gradwire.v1.BlockScales): the tensor reads as a matrix
// [rows, cols] (cols its last dimension), cut into blocks of block_rows x block_cols from (0, 0),
// and each block's codes decode to decode(code) * its scale_inv. Absent while block_rows is 0.
struct BlockScales {
  int64_t block_rows = 0;
  int64_t block_cols = 0;
  std::vector<float> scale_inv;  // the grid [ceil(rows / block_rows), ceil(cols / block_cols)]
  bool present() const { return block_rows > 0; }
  // Every scale_inv a power of two 2^e with e in the block recipes' range [-50, 50]
  // (kernels/ref/block_scaling.h): what a recipe's own cast makes.
  bool PowersOfTwoInRange() const;
};

// A tensor as it arrived: `data` holds numel() elements of `dtype` (not owned: the caller keeps it
// alive while the view is used), and for a block-scaled FP8 tensor with a columnwise copy, numel()
// more: the codes of its transpose [cols, rows]. FP8 values are decode(code) * scale_inv, or with
// block scales, decode(code) * the scale_inv of the code's block (owned copies of the scales).
struct TensorView {
  DType dtype = DType::kF32;
  const void* data = nullptr;
  std::vector<int64_t> shape;
  float scale_inv = 1.0f;  // FP8 with one scale
  BlockScales blocks;      // FP8 with block scales (then scale_inv is not read)
  BlockScales columnwise;  // with blocks: the columnwise copy's, over [cols, rows]
  int64_t numel() const;   // 0 for an empty shape
  int64_t cols() const { return shape.empty() ? 0 : shape.back(); }
  int64_t rows() const { return cols() > 0 ? numel() / cols() : 0; }
  int64_t bytes() const { return numel() * ElementSize(dtype) * (columnwise.present() ? 2 : 1); }
  // The columnwise copy's codes (nullptr without one).
  const uint8_t* columnwise_codes() const;
};

// A tensor encoded for the wire, owning its bytes (a std::string, so a protobuf message can take
// it without a copy): the codes of both copies when it has a columnwise one.
struct EncodedTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::string bytes;
  float scale_inv = 1.0f;  // FP8 with one scale
  BlockScales blocks;      // FP8 with block scales
  BlockScales columnwise;
};

// Decodes n elements of `dtype` at `bytes` to float32 (FP8: times scale_inv).
void DecodeElements(DType dtype, const void* bytes, int64_t n, float scale_inv, float* out);
// Decodes a view's values (its first copy) to float32, whatever its scales.
void DecodeView(const TensorView& v, float* out);

// The scale an FP8 encoding of values with this amax uses (current scaling, margin 0): the
// encoder's choice, so that a tensor split over threads is encoded as one.
float Fp8EncodeScale(DType dtype, float amax);
// Largest |x| over n values (NaN propagates).
float AbsMax(const float* x, int64_t n);

// Encodes n float32 values as `dtype` into out (n * ElementSize bytes). FP8 multiplies by
// `fp8_scale` (Fp8EncodeScale of the whole tensor's amax) before rounding; others ignore it.
void EncodeElements(const float* x, int64_t n, DType dtype, float fp8_scale, void* out);

// One tensor: FP8 takes its scale from these values alone; returns the scale_inv to send with it
// (1 for the other dtypes).
float EncodeTensor(const float* x, int64_t n, DType dtype, void* out);

// How an FP8 tensor is scaled on the wire: one scale for the tensor (block 0), or a power-of-two
// scale for each 1 x block run of a row, cast as the BLOCK (block 128) and MXFP8 (block 32)
// recipes cast activations and gradients (kernels::QuantizeBlocks, docs/block-scaling.md), with
// optionally the columnwise copy those recipes' weight gradient casts: the transpose, 1 x block
// along each of its rows.
struct Fp8Scaling {
  int64_t block = 0;
  bool columnwise = false;
};
// Bytes of codes a tensor of n elements takes under `scaling` (FP8 only).
inline int64_t Fp8Bytes(int64_t n, Fp8Scaling scaling) {
  return scaling.block > 0 && scaling.columnwise ? 2 * n : n;
}
// Encodes x (the matrix [rows, cols], row-major) as FP8 `dtype` with block scales into `codes`
// (Fp8Bytes of rows * cols) and returns the scales (`columnwise`, when asked for, gets the
// columnwise copy's). scaling.block must be > 0.
BlockScales EncodeBlocks(const float* x, int64_t rows, int64_t cols, DType dtype,
                         Fp8Scaling scaling, void* codes, BlockScales* columnwise);
// An encoded tensor of `shape` in `dtype`: FP8 under `scaling` (one scale when block is 0).
// `known_amax` >= 0 is the values' AbsMax when the caller has it already (one scale for the
// tensor: the encoder then does not measure it again).
EncodedTensor Encode(const float* x, std::vector<int64_t> shape, DType dtype,
                     Fp8Scaling scaling = {}, float known_amax = -1.0f);

}  // namespace gradwire::wire
