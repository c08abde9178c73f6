#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into tests/fuzz/corpus/ (small, committed).

Run from anywhere: python3 tests/fuzz/make_seeds.py. Needs protoc (protobuf-compiler) for the
request seeds, which are text-format protos encoded with `protoc --encode`.
"""
import json
import os
import random
import struct
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
rng = random.Random(20261122)


def write(target, name, data):
    with open(os.path.join(HERE, "corpus", target, name), "wb") as f:
        f.write(data)


def floats(n):
    return struct.pack("<%df" % n, *[rng.uniform(-2, 2) for _ in range(n)])


def safetensors(tensors, metadata=None):
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


# safetensors_fuzzer: every dtype, a scalar, an empty tensor, metadata.
write("safetensors_fuzzer", "f32_bias", safetensors(
    [("weight", "F32", [2, 3], floats(6)), ("bias", "F32", [2], floats(2))],
    {"format": "pt"}))
write("safetensors_fuzzer", "all_dtypes", safetensors(
    [("a", "BF16", [3], bytes(rng.randrange(256) for _ in range(6))),
     ("b", "F16", [1, 2], bytes(rng.randrange(256) for _ in range(4))),
     ("c", "F8_E4M3", [4], bytes(rng.randrange(256) for _ in range(4))),
     ("d", "F8_E5M2", [2, 2], bytes(rng.randrange(256) for _ in range(4)))]))
write("safetensors_fuzzer", "scalar_and_empty", safetensors(
    [("s", "F32", [], floats(1)), ("e", "F32", [0, 3], b"")]))
write("safetensors_fuzzer", "header_only", safetensors([], {"k": "v"}))


def spec(kind, in_f, out_f, ffn=0, activation=0, mode=0):
    return {"kind": kind, "in_features": in_f, "out_features": out_f, "ffn_features": ffn,
            "bias": True, "activation": activation, "layernorm_eps": 1e-5,
            "zero_centered_gamma": False, "return_layernorm_output": False, "checkpoint": False,
            "recipe": {"mode": mode, "margin": 0, "history_len": 4, "algo": 0},
            "optimizer": {"kind": 0,
                          "sgd": {"learning_rate": 0.01, "momentum": 0.0, "weight_decay": 0.0,
                                  "nesterov": False},
                          "adamw": {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999,
                                    "eps": 1e-8, "weight_decay": 0.01}},
            "max_staleness": -1, "seed": 3, "name": "seed"}


def checkpoint(s, params, slots=(), roles=("input", "weight", "grad_output")):
    tensors = [("param." + n, "F32", shape, floats(_numel(shape))) for n, shape in params]
    tensors += [("slot." + n, "F32", shape, floats(_numel(shape))) for n, shape in slots]
    scaling = [{"role": r, "scale": 1.5, "history": [0.5, 1.0]} for r in roles]
    return safetensors(tensors, {
        "format": "gradwire-checkpoint", "format_version": "1", "module_id": "m1",
        "tenant": "", "weight_version": "3", "optimizer_steps": "2",
        "spec": json.dumps(s), "scaling": json.dumps(scaling)})


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# checkpoint_fuzzer: one restorable checkpoint per module kind.
write("checkpoint_fuzzer", "linear", checkpoint(
    spec(0, 4, 3), [("weight", [3, 4]), ("bias", [3])], [("weight.first", [3, 4])]))
write("checkpoint_fuzzer", "layernorm_linear_delayed", checkpoint(
    spec(1, 4, 2, mode=1),
    [("layer_norm_weight", [4]), ("layer_norm_bias", [4]), ("weight", [2, 4]), ("bias", [2])]))
write("checkpoint_fuzzer", "layernorm_mlp_swiglu", checkpoint(
    spec(2, 4, 2, ffn=3, activation=2),
    [("layer_norm_weight", [4]), ("layer_norm_bias", [4]), ("fc1_weight", [6, 4]),
     ("fc1_bias", [6]), ("fc2_weight", [2, 3]), ("fc2_bias", [2])],
    roles=("fc1_input", "fc1_weight")))

# Regression: a spec whose kind is out of range must be refused (it indexed past the kind names).
write("checkpoint_fuzzer", "regression_kind_out_of_range", checkpoint(
    spec(3, 4, 3), [("weight", [3, 4]), ("bias", [3])]))
write("checkpoint_fuzzer", "regression_activation_out_of_range", checkpoint(
    spec(2, 4, 2, ffn=3, activation=9),
    [("layer_norm_weight", [4]), ("layer_norm_bias", [4]), ("fc1_weight", [3, 4]),
     ("fc1_bias", [3]), ("fc2_weight", [2, 3]), ("fc2_bias", [2])],
    roles=("fc1_input", "fc1_weight")))

# Regression: numbers out of their field's range must be refused, not converted (a float seed of
# 3e20 into a uint64, a float field of 1e300, a remembered amax of 1e300).
_wide = spec(0, 4, 3)
_wide["seed"] = 3.18447e20
write("checkpoint_fuzzer", "regression_seed_out_of_range", checkpoint(
    _wide, [("weight", [3, 4]), ("bias", [3])]))
_wide = spec(0, 4, 3)
_wide["layernorm_eps"] = 1e300
write("checkpoint_fuzzer", "regression_float_out_of_range", checkpoint(
    _wide, [("weight", [3, 4]), ("bias", [3])]))

# request_fuzzer: mode byte, selector byte, then a serialized request (or a raw tensor).
def encode(message, text):
    return subprocess.run(
        ["protoc", "--proto_path=" + os.path.join(ROOT, "proto"),
         "--encode=gradwire.v1." + message, "gradwire/v1/service.proto"],
        input=text.encode(), capture_output=True, check=True).stdout


def tensor_text(dtype, shape, raw, scale_inv=None):
    data = "".join("\\%03o" % b for b in raw)
    text = "dtype: %s %s data: \"%s\"" % (dtype, " ".join("shape: %d" % d for d in shape), data)
    if scale_inv is not None:
        text += " scale_inv: %g" % scale_inv
    return text


raw8 = bytes(rng.randrange(256) for _ in range(16))
write("request_fuzzer", "forward_f32", bytes([0, 0]) + encode(
    "ForwardRequest", "input { %s } training: true" % tensor_text("F32", [2, 8], floats(16))))
write("request_fuzzer", "forward_bf16_ln", bytes([0, 1]) + encode(
    "ForwardRequest", "input { %s } training: true output_dtype: BF16"
    % tensor_text("BF16", [1, 8], floats(4))))
write("request_fuzzer", "forward_fp8", bytes([0, 2]) + encode(
    "ForwardRequest", "input { %s } output_dtype: FP8_E4M3"
    % tensor_text("FP8_E4M3", [2, 8], raw8, 0.03125)))
# Block scales (docs/wire.md): [2, 8] codes in 1 x 8 blocks (a grid of 2), then the columnwise
# copy's [8, 2] codes in 1 x 2 blocks (a grid of 8); and a block-scaled E5M2 gradient.
def octal(raw):
    return "".join("\\%03o" % b for b in raw)


raw16x2 = bytes(random.Random(20261207).randrange(256) for _ in range(32))  # apart from rng
write("request_fuzzer", "forward_fp8_blocks", bytes([0, 2]) + encode(
    "ForwardRequest", "input { dtype: FP8_E4M3 shape: 2 shape: 8 data: \"%s\" "
    "block_scales { block_rows: 1 block_cols: 8 scale_inv: \"%s\" } "
    "columnwise_scales { block_rows: 1 block_cols: 2 scale_inv: \"%s\" } } training: true "
    "output_dtype: FP8_E4M3" % (octal(raw16x2), octal(struct.pack("<2f", 0.25, 8.0)),
                                octal(struct.pack("<8f", *[2.0 ** -k for k in range(8)])))))
write("request_fuzzer", "backward_fp8_blocks", bytes([1, 0x10]) + encode(
    "BackwardRequest", "grad_output { dtype: FP8_E5M2 shape: 2 shape: 4 data: \"%s\" "
    "block_scales { block_rows: 1 block_cols: 4 scale_inv: \"%s\" } } grad_input_dtype: FP8_E5M2"
    % (octal(raw8[:8]), octal(struct.pack("<2f", 1.0, 0.5)))))
write("request_fuzzer", "backward_f32", bytes([1, 0x10]) + encode(
    "BackwardRequest", "grad_output { %s } retain: false" % tensor_text("F32", [2, 4], floats(8))))
write("request_fuzzer", "backward_ln_grad", bytes([1, 0x01]) + encode(
    "BackwardRequest", "grad_output { %s } grad_layernorm_output { %s }"
    % (tensor_text("F16", [1, 4], floats(2)), tensor_text("F32", [1, 8], floats(8)))))
write("request_fuzzer", "set_weights", bytes([2, 0]) + encode(
    "SetWeightsRequest", "parameters { name: \"weight\" tensor { %s } } "
    "parameters { name: \"bias\" tensor { %s } }"
    % (tensor_text("F32", [4, 8], floats(32)), tensor_text("F32", [4], floats(4)))))
write("request_fuzzer", "raw_e5m2", bytes([3, 0x03, 5, 2]) + struct.pack("<qqf", 2, 8, 0.5)
      + raw8)
write("request_fuzzer", "raw_f16", bytes([3, 0x01, 3, 1]) + struct.pack("<qf", 8, 1.0)
      + floats(4))

# zero_copy_fuzzer: one byte (message type in the low 2 bits, slice count above), then the
# serialized message.
write("zero_copy_fuzzer", "forward_request", bytes([0 | 3 << 2]) + encode(
    "ForwardRequest", "module_id: \"0123456789abcdef0123456789abcdef\" input { %s } "
    "training: true output_dtype: BF16" % tensor_text("F32", [2, 3], floats(6))))
write("zero_copy_fuzzer", "backward_request", bytes([1 | 1 << 2]) + encode(
    "BackwardRequest", "context_id: \"c\" grad_output { %s } grad_layernorm_output { %s } "
    "retain: true" % (tensor_text("F32", [1, 4], floats(4)), tensor_text("F16", [1, 2], floats(1)))))
write("zero_copy_fuzzer", "forward_response", bytes([2 | 5 << 2]) + encode(
    "ForwardResponse", "output { %s } layernorm_output { %s } context_id: \"x\" "
    "server_seconds: 0.25" % (tensor_text("F32", [2, 2], floats(4)),
                             tensor_text("FP8_E4M3", [2], raw8[:2], 0.5))))
write("zero_copy_fuzzer", "chunk_part", bytes([3 | 2 << 2]) + encode(
    "ForwardRequestPart", "chunk { tensor: 0 offset: 4096 data: \"%s\" }"
    % "".join("\\x%02x" % b for b in floats(16))))
write("zero_copy_fuzzer", "shared_memory_ref", bytes([0 | 1 << 2]) + encode(
    "ForwardRequest", "module_id: \"m\" input { dtype: F32 shape: 4 "
    "shared_memory { region: \"r\" offset: 8 byte_size: 16 } }"))

# A backward whose grad_output is an FP8 cast with the bias gradient beside it
# (grad_output_column_sums): per tensor, and in row blocks with the columnwise copy.
write("request_fuzzer", "backward_fp8_sums", bytes([1, 0x10]) + encode(
    "BackwardRequest", "grad_output { dtype: FP8_E5M2 shape: 2 shape: 4 data: \"%s\" "
    "scale_inv: 0.5 } grad_output_column_sums: [0.5, -1.25, 3.0, 0.0]" % octal(raw8[:8])))
write("request_fuzzer", "backward_fp8_blocks_sums", bytes([1, 0x10]) + encode(
    "BackwardRequest", "grad_output { dtype: FP8_E4M3 shape: 2 shape: 4 data: \"%s\" "
    "block_scales { block_rows: 1 block_cols: 4 scale_inv: \"%s\" } "
    "columnwise_scales { block_rows: 1 block_cols: 2 scale_inv: \"%s\" } } "
    "grad_output_column_sums: [1.0, 2.0, -0.75, 4.5]"
    % (octal(raw8[:8] + raw8[8:16]), octal(struct.pack("<2f", 1.0, 0.5)),
       octal(struct.pack("<4f", 0.25, 0.5, 1.0, 2.0)))))
