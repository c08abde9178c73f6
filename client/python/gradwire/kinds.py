"""Module kinds as the wire contract describes them.

Each ``gradwire.v1.ModuleKind`` value in ``module.proto`` carries a ``KindDescription`` option:
its class name, its ``--kind`` name, the ``ModuleSpec`` fields it reads beyond the common ones,
and the width fields that give its shape. It is the one table of kinds every client reads (this
package, and the C++ client, CLI, load tool and libtorch module), so a new kind needs no case in
a client.
"""

from typing import List, Optional, Tuple

from gradwire.v1 import module_pb2, tensor_pb2


def describe(kind: int) -> Optional[module_pb2.KindDescription]:
    """The description of ``kind``, or None for MODULE_KIND_UNSPECIFIED and values this package
    does not know (a newer server's kind)."""
    value = module_pb2.ModuleKind.DESCRIPTOR.values_by_number.get(int(kind))
    if value is None:
        return None
    options = value.GetOptions()
    if not options.HasExtension(module_pb2.kind_description):
        return None
    return options.Extensions[module_pb2.kind_description]


def kinds() -> List[int]:
    """Every kind the contract names, in enum order."""
    return [v.number for v in module_pb2.ModuleKind.DESCRIPTOR.values
            if describe(v.number) is not None]


def name(kind: int) -> str:
    """The enum name ("LAYERNORM_MLP"), or the number as text for a kind this package does not
    know."""
    value = module_pb2.ModuleKind.DESCRIPTOR.values_by_number.get(int(kind))
    return value.name if value is not None else str(kind)


def by_name(text: str) -> Optional[int]:
    """The kind whose ``--kind`` name ("layernorm-mlp") or enum name ("LAYERNORM_MLP") is
    ``text``."""
    for kind in kinds():
        if text in (describe(kind).cli_name, name(kind)):
            return kind
    return None


def reads(kind: int, field: str) -> bool:
    """Whether a module of ``kind`` reads ``field`` of its spec (beyond the fields every kind
    reads)."""
    d = describe(kind)
    return d is not None and field in d.spec_fields


def widths(spec: module_pb2.ModuleSpec) -> List[Tuple[str, int]]:
    """The widths of ``spec``'s module in order, by field name: ``[("in_features", 1024),
    ("ffn_features", 4096), ("out_features", 1024)]`` for a LayerNormMLP."""
    d = describe(spec.kind)
    return [] if d is None else [(f, getattr(spec, f)) for f in d.widths]


def block_size(spec: module_pb2.ModuleSpec) -> int:
    """The block length of the module's recipe along a row of an activation or a gradient: 128
    under BLOCK, 32 under MXFP8, 0 under the per-tensor recipes (CURRENT, DELAYED, unspecified).
    An FP8 tensor to or from such a module crosses with block scales of 1 x that length."""
    return {module_pb2.BLOCK: 128, module_pb2.MXFP8: 32}.get(spec.recipe.scaling, 0)


def exact_fp8_input(spec: module_pb2.ModuleSpec) -> bool:
    """Whether the exact wire sends a forward's input to a module of ``spec`` as E4M3 codes: its
    kind takes FP8 input codes as they arrive (``KindDescription.fp8_input``: a Linear) and its
    recipe's cast of the input is one the client makes bit for bit: CURRENT (or unspecified)
    with margin 0 (one scale, ``wire.encode_exact_input``), BLOCK or MXFP8 (a power-of-two scale
    per 1 x ``block_size`` block of a row, and in training the columnwise copy too:
    ``wire.encode_exact_block_input``). DELAYED (the server's history sets the scale) and a
    margin keep the input as it is."""
    d = describe(spec.kind)
    if d is None or not d.fp8_input or spec.recipe.margin != 0:
        return False
    return spec.recipe.scaling in (module_pb2.SCALING_RECIPE_UNSPECIFIED, module_pb2.CURRENT,
                                   module_pb2.BLOCK, module_pb2.MXFP8)


def exact_grad_output(spec: module_pb2.ModuleSpec, row_order_bias_sums: bool) -> Optional[int]:
    """The FP8 dtype (``tensor_pb2.FP8_E4M3`` or ``FP8_E5M2``) in which the exact wire sends a
    backward's grad_output to a module of ``spec``, or None (it stays F32): its kind casts
    grad_output to FP8 before anything else reads it but for the bias gradient
    (``KindDescription.fp8_grad_output``), and its recipe's cast is one the client makes bit for
    bit: CURRENT (or unspecified) with margin 0 (E5M2, one scale), BLOCK (E4M3, or E5M2 under
    the HYBRID format) or MXFP8 (E4M3), each with 1 x ``block_size`` blocks along a row and the
    columnwise copy (``wire.encode_exact_gradient``). A module with a bias takes its bias
    gradient from the column sums sent beside the codes, so only from a server that sums
    columns as the client does: ``row_order_bias_sums`` (``ModuleInfo.row_order_bias_sums``).
    DELAYED (the server's history sets the scale) and a margin keep grad_output F32."""
    d = describe(spec.kind)
    if d is None or not d.fp8_grad_output:
        return None
    if spec.bias and not row_order_bias_sums:
        return None
    scaling = spec.recipe.scaling
    if scaling == module_pb2.BLOCK:
        return tensor_pb2.FP8_E5M2 if spec.recipe.format == module_pb2.HYBRID \
            else tensor_pb2.FP8_E4M3
    if scaling == module_pb2.MXFP8:
        return tensor_pb2.FP8_E4M3
    if scaling in (module_pb2.SCALING_RECIPE_UNSPECIFIED, module_pb2.CURRENT) and \
            spec.recipe.margin == 0:
        return tensor_pb2.FP8_E5M2
    return None
