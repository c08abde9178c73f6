"""Module kinds come from one table, the KindDescription option on each ModuleKind value of the
wire contract (gradwire.kinds): the package's names, shape arithmetic and classes read it, and a
kind it does not know is a module with no optional fields."""

import gradwire
from gradwire import kinds
from gradwire.v1 import module_pb2

SPEC_FIELDS = module_pb2.ModuleSpec.DESCRIPTOR.fields_by_name


def test_every_kind_of_the_contract_is_described():
    named = [v.number for v in module_pb2.ModuleKind.DESCRIPTOR.values if v.number != 0]
    assert kinds.kinds() == named
    for kind in named:
        d = kinds.describe(kind)
        assert d.class_name and d.cli_name
        assert kinds.by_name(d.cli_name) == kind
        assert kinds.by_name(kinds.name(kind)) == kind
        # Its fields are the spec's, its widths int64 fields it has, starting at the input.
        for field in d.spec_fields:
            assert field in SPEC_FIELDS, field
        assert d.widths[0] == "in_features" and d.widths[-1] == "out_features"
        for field in d.widths:
            assert SPEC_FIELDS[field].type == SPEC_FIELDS[field].TYPE_INT64, field


def test_reads_and_widths_follow_the_table():
    mlp = module_pb2.ModuleSpec(kind=module_pb2.LAYERNORM_MLP, in_features=8, ffn_features=32,
                                out_features=4)
    assert kinds.widths(mlp) == [("in_features", 8), ("ffn_features", 32), ("out_features", 4)]
    linear = module_pb2.ModuleSpec(kind=module_pb2.LINEAR, in_features=8, ffn_features=32,
                                   out_features=4)
    assert kinds.widths(linear) == [("in_features", 8), ("out_features", 4)]
    assert kinds.reads(module_pb2.LAYERNORM_MLP, "ffn_features")
    assert kinds.reads(module_pb2.LAYERNORM_LINEAR, "return_layernorm_output")
    assert not kinds.reads(module_pb2.LINEAR, "return_layernorm_output")
    assert not kinds.reads(module_pb2.LINEAR, "ffn_features")


def test_an_unknown_kind_has_no_optional_fields():
    assert kinds.describe(0) is None and kinds.describe(99) is None
    assert not kinds.reads(99, "return_layernorm_output")
    assert kinds.widths(module_pb2.ModuleSpec(kind=99, in_features=8)) == []
    assert kinds.name(99) == "99" and kinds.by_name("conv2d") is None


def test_attach_finds_the_class_of_each_kind(client):
    made = [gradwire.RemoteLinear(client, 4, 2), gradwire.RemoteLayerNormLinear(client, 4, 2),
            gradwire.RemoteLayerNormMLP(client, 4, 8)]
    for m in made:
        attached = gradwire.RemoteModule.attach(client, m.module_id)
        assert type(attached) is type(m)
        assert attached.kind == kinds.name(m.spec.kind)
