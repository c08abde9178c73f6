"""Discoverable: a repr with sizes, kind, server and id; explicit, typed, documented keyword
arguments (no **kwargs hiding keep, recompute_on_lost_context or where); py.typed; DEBUG logging
of every call."""

import inspect
import logging
import os
import re

import torch

import gradwire

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = (gradwire.RemoteLinear, gradwire.RemoteLayerNormLinear, gradwire.RemoteLayerNormMLP)


def test_repr_names_sizes_kind_server_and_id(client):
    m = gradwire.RemoteLinear(client, 12, 5, optimizer="sgd", lr=0.05, momentum=0.9)
    text = repr(m)
    for part in ("RemoteLinear(", "in_features=12", "out_features=5", "bias=True",
                 "kind=LINEAR", f"server={client.server}", f"id={m.module_id}",
                 "optimizer=sgd(lr=0.05, momentum=0.9)"):
        assert part in text, (part, text)
    mlp = repr(gradwire.RemoteLayerNormMLP(client, 8, 32, 4, activation="swiglu"))
    for part in ("hidden_size=8", "ffn_hidden_size=32", "out_features=4", "activation=swiglu",
                 "kind=LAYERNORM_MLP", "optimizer=local"):
        assert part in mlp, (part, mlp)
    assert "micro_batches=2" in repr(gradwire.RemoteSequential([m], micro_batches=2))
    assert client.server in repr(client)


def test_keyword_arguments_are_explicit_typed_and_documented():
    for cls in KINDS:
        sig = inspect.signature(cls.__init__)
        assert not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()), cls
        doc = inspect.getdoc(cls)
        for name, p in sig.parameters.items():
            if name == "self":
                continue
            assert p.annotation is not inspect.Parameter.empty, (cls, name)
            assert re.search(rf"\b{name}\b", doc), f"{cls.__name__} does not document {name}"
        for name in ("keep", "recompute_on_lost_context", "where", "optimizer", "lr"):
            assert sig.parameters[name].kind == inspect.Parameter.KEYWORD_ONLY, (cls, name)


def test_public_methods_are_documented_and_typed():
    for cls in (gradwire.RemoteModule, gradwire.Client, gradwire.RemoteSequential,
                gradwire.ServerOptimizer, gradwire.Cluster):
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_") or fn.__module__ != cls.__module__:
                continue
            assert inspect.getdoc(fn), f"{cls.__name__}.{name} has no docstring"
    for name in ("get_weights", "set_weights", "get_gradients", "apply_gradients", "pull",
                 "push", "delete"):
        sig = inspect.signature(getattr(gradwire.RemoteModule, name))
        assert sig.return_annotation is not inspect.Signature.empty, name


def test_py_typed_is_shipped():
    assert os.path.isfile(os.path.join(PACKAGE, "gradwire", "py.typed"))
    with open(os.path.join(PACKAGE, "pyproject.toml")) as f:
        assert re.search(r'gradwire = \["py.typed"\]', f.read())


def test_debug_logging_of_calls(client, caplog):
    caplog.set_level(logging.DEBUG, logger="gradwire")
    m = gradwire.RemoteLinear(client, 4, 2)
    m(torch.randn(3, 4)).sum().backward()
    m.delete()
    lines = [r.getMessage() for r in caplog.records if r.name == "gradwire"]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "gradwire")
    for call in ("CreateModule", "GetWeights", "Train.Forward", "Train.Backward",
                 "GetGradients", "DeleteModule"):
        assert any(line.startswith(call + " ") for line in lines), (call, lines)
    assert any(m.module_id in line and " ms" in line for line in lines), lines
