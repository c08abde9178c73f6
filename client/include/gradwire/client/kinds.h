// Module kinds as the wire contract describes them: each gradwire.v1.ModuleKind value carries a
// KindDescription option in module.proto (its names, the spec fields it reads, its widths). It is
// the one table of kinds every client reads (this library, the CLI, gradwire-load, the libtorch
// module; the Python package reads the same option), so a new kind needs no case in a client.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "gradwire/v1/module.pb.h"

namespace gradwire::client {

// The description of `kind`, or null for MODULE_KIND_UNSPECIFIED and values the contract does not
// name (a newer server's kind).
const v1::KindDescription* DescribeKind(v1::ModuleKind kind);
// Every kind the contract names, in enum order.
std::vector<v1::ModuleKind> ModuleKinds();
// The kind whose cli_name ("layernorm-mlp") or enum name ("LAYERNORM_MLP") is `name`.
std::optional<v1::ModuleKind> KindByName(absl::string_view name);
// Whether a module of `kind` reads `field` of its ModuleSpec (beyond the fields every kind reads).
bool KindReads(v1::ModuleKind kind, absl::string_view field);
// The widths of `spec`'s module in order, by field name: {{"in_features", 1024},
// {"ffn_features", 4096}, {"out_features", 1024}} for a LayerNormMLP. Empty for an unknown kind.
std::vector<std::pair<std::string, int64_t>> KindWidths(const v1::ModuleSpec& spec);
// Whether the exact wire (host_tensor.h: WireForm) sends a forward's input to a module of `spec` as
// E4M3 codes: its kind takes FP8 input codes (KindDescription.fp8_input) and its recipe is CURRENT
// (or unspecified) with margin 0, BLOCK or MXFP8, where a client's cast is the server's, bit for
// bit (under BLOCK and MXFP8 with the recipe's blocks, RecipeBlockLength). DELAYED (a scale from
// the server's history) and a margin keep the input F32.
bool ExactWireTakesFp8(const v1::ModuleSpec& spec);
// The FP8 form in which the exact wire sends a backward's grad_output to a module of `spec`, where
// a client's cast is the server's bit for bit: its kind takes FP8 grad_output codes
// (KindDescription.fp8_grad_output) and its recipe is CURRENT (or unspecified) with margin 0 (E5M2,
// one scale), BLOCK (E4M3, or E5M2 under HYBRID) or MXFP8 (E4M3), with the recipe's row blocks and
// the columnwise copy. A module with a bias takes its bias gradient as the gradient's column sums
// beside it, so only from a server that sums them as the client does
// (ModuleInfo.row_order_bias_sums). kNone: grad_output stays F32.
enum class ExactGradForm { kNone, kE4M3, kE5M2 };
ExactGradForm ExactWireGradForm(const v1::ModuleSpec& spec, bool row_order_bias_sums);
// The row block length of `spec`'s recipe, which its FP8 wire tensors use both ways: 128 under
// BLOCK, 32 under MXFP8; 0 (one scale per tensor) under the others.
int64_t RecipeBlockLength(const v1::ModuleSpec& spec);
// The --kind values ("linear", "layernorm-linear", "layernorm-mlp"), and them joined by ", ".
std::vector<std::string> KindCliNames();
std::string KindNames();

}  // namespace gradwire::client
