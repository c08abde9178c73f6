// QueuedReadsBackend: Backend::HostWaits modelled on the host (tests).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <utility>
#include <vector>

#include "server/device/reference_backend.h"

namespace gradwire::testing {

// A model of a GPU's host waits, for Backend::HostWaits counts on the host: the reference backend,
// with every cast's scalars and every AbsMaxLater handed back lazily, as values queued behind the
// kernels. A ToWire or a synchronous AbsMax waits for everything queued so far; a read by the
// host of a value not yet covered by a wait is a wait of its own. The backend's own kernels (a
// GPU's read the scalars on the device) get the values directly, by the codes they belong to
// (right for codes made by Cast, which is where a module's GEMM operands come from); a kernel
// that reached for a lazy value would throw, so no read is hidden from the count. libtorch's own
// reads (a refused call's scan) are not counted, as on the GPU.
class QueuedReadsBackend final : public device::ReferenceBackend {
 public:
  absl::StatusOr<device::Fp8Tensor> Cast(const at::Tensor& x, const device::QuantizerConfig& config,
                                         device::CastUsage usage) const override {
    absl::StatusOr<device::Fp8Tensor> t;
    {
      const Kernel k(this);
      t = device::ReferenceBackend::Cast(x, config, usage);
    }
    if (!t.ok()) return t;
    const std::array<float, 3> v = {t->scale(), t->scale_inv(), t->amax()};
    for (const at::Tensor* codes : {&t->rowwise, &t->columnwise}) {
      if (codes->defined()) values_[codes->data_ptr()] = v;
    }
    t->scalars = Later(v);
    return t;
  }
  at::Tensor Dequantize(const device::Fp8Tensor& t, bool rowwise) const override {
    const Kernel k(this);
    return device::ReferenceBackend::Dequantize(Resolved(t), rowwise);
  }
  at::Tensor Fprop(const device::Fp8Tensor& x, const device::Fp8Tensor& w,
                   const at::Tensor& bias) const override {
    const Kernel k(this);
    return device::ReferenceBackend::Fprop(Resolved(x), Resolved(w), bias);
  }
  at::Tensor Dgrad(const device::Fp8Tensor& dy, const device::Fp8Tensor& w) const override {
    const Kernel k(this);
    return device::ReferenceBackend::Dgrad(Resolved(dy), Resolved(w));
  }
  void Wgrad(const device::Fp8Tensor& dy, const device::Fp8Tensor& x, at::Tensor& acc,
             bool accumulate) const override {
    const Kernel k(this);
    device::ReferenceBackend::Wgrad(Resolved(dy), Resolved(x), acc, accumulate);
  }
  bool Supports(device::Op op) const override {
    return op == device::Op::kAbsMaxLater || ReferenceBackend::Supports(op);
  }
  device::CastScalars AbsMaxLater(const at::Tensor& x) const override {
    return Later({1.0f, 1.0f, device::ReferenceBackend::AbsMax(x)});
  }
  float AbsMax(const at::Tensor& x) const override {
    Wait();
    return device::ReferenceBackend::AbsMax(x);
  }
  float AddAbsMax(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) const override {
    Wait();
    return device::ReferenceBackend::AddAbsMax(a, b, out);
  }
  wire::EncodedTensor ToWire(const at::Tensor& x, wire::DType dtype,
                             std::vector<int64_t> shape) const override {
    Wait();
    return device::ReferenceBackend::ToWire(x, dtype, std::move(shape));
  }
  int64_t HostWaits() const override { return waits_; }

 private:
  struct Kernel {
    explicit Kernel(const QueuedReadsBackend* b) : b(b) { ++b->inside_; }
    ~Kernel() { --b->inside_; }
    const QueuedReadsBackend* b;
  };
  // t with its scalars as host values, found by its codes (as a GPU kernel finds them by pointer).
  device::Fp8Tensor Resolved(const device::Fp8Tensor& t) const {
    device::Fp8Tensor c = t;
    for (const at::Tensor* codes : {&t.rowwise, &t.columnwise}) {
      if (!codes->defined()) continue;
      auto it = values_.find(codes->data_ptr());
      if (it == values_.end()) continue;
      c.scalars = device::CastScalars(it->second[0], it->second[1], it->second[2]);
      break;
    }
    return c;
  }
  device::CastScalars Later(std::array<float, 3> v) const {
    const int64_t mark = ++queued_;
    return device::CastScalars([this, v, mark] {
      if (inside_ > 0) throw std::logic_error("a kernel read a cast's scalars from the host");
      if (done_ < mark) Wait();
      return v;
    });
  }
  void Wait() const {
    ++waits_;
    done_ = queued_;
  }
  mutable std::map<const void*, std::array<float, 3>> values_;
  mutable int64_t queued_ = 0, done_ = 0, waits_ = 0, inside_ = 0;
};

}  // namespace gradwire::testing
