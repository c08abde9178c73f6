// Module specs the service suites create, so each test states only the widths and options it is
// about. Arguments left out keep the wire contract's defaults (no bias, seed 0, current scaling).
#pragma once

#include <cstdint>

#include "gradwire/v1/module.pb.h"

namespace gradwire::testing {

// Linear in -> out.
inline v1::ModuleSpec LinearSpec(int64_t in, int64_t out, bool bias = false, uint64_t seed = 0) {
  v1::ModuleSpec spec;
  spec.set_kind(v1::LINEAR);
  spec.set_in_features(in);
  spec.set_out_features(out);
  spec.set_bias(bias);
  spec.set_seed(seed);
  return spec;
}

// LayerNorm, then Linear in -> out.
inline v1::ModuleSpec LayerNormLinearSpec(int64_t in, int64_t out, bool bias = false,
                                          uint64_t seed = 0) {
  v1::ModuleSpec spec = LinearSpec(in, out, bias, seed);
  spec.set_kind(v1::LAYERNORM_LINEAR);
  return spec;
}

// LayerNorm, FC1 in -> ffn, `activation`, FC2 ffn -> in.
inline v1::ModuleSpec LayerNormMlpSpec(int64_t in, int64_t ffn, v1::Activation activation,
                                       bool bias = false, uint64_t seed = 0) {
  v1::ModuleSpec spec = LinearSpec(in, in, bias, seed);
  spec.set_kind(v1::LAYERNORM_MLP);
  spec.set_ffn_features(ffn);
  spec.set_activation(activation);
  return spec;
}

}  // namespace gradwire::testing
