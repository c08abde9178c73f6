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

// A tensor as it arrived, not owned: `data` holds numel() elements of `dtype` (the caller keeps
// it alive while the view is used). FP8 values are decode(code) * scale_inv.
struct TensorView {
  DType dtype = DType::kF32;
  const void* data = nullptr;
  std::vector<int64_t> shape;
  float scale_inv = 1.0f;  // FP8 only
  int64_t numel() const;   // 0 for an empty shape
  int64_t bytes() const { return numel() * ElementSize(dtype); }
};

// A tensor encoded for the wire, owning its bytes (a std::string, so a protobuf message can take
// it without a copy).
struct EncodedTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::string bytes;
  float scale_inv = 1.0f;  // FP8 only
};

// Decodes n elements of `dtype` at `bytes` to float32 (FP8: times scale_inv).
void DecodeElements(DType dtype, const void* bytes, int64_t n, float scale_inv, float* out);

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

}  // namespace gradwire::wire
