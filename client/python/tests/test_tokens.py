"""Bearer tokens from the Python client: each tenant sees only its own modules."""
import pytest
import torch

import gradwire
from conftest import TENANT_TOKENS


def test_tenants_are_isolated(token_server, monkeypatch):
    alice = gradwire.Client(token_server, token=TENANT_TOKENS["alice"])
    monkeypatch.setenv("GRADWIRE_TOKEN", TENANT_TOKENS["bob"])
    bob = gradwire.Client(token_server)  # the token from GRADWIRE_TOKEN
    monkeypatch.delenv("GRADWIRE_TOKEN")
    anonymous = gradwire.Client(token_server)
    try:
        layer = gradwire.RemoteLinear(alice, 16, 8, seed=1)
        x = torch.randn(4, 16, requires_grad=True)
        layer(x).square().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        assert [m.module_id for m in alice.list_modules()] == [layer.module_id]
        assert bob.list_modules() == []
        with pytest.raises(gradwire.GradwireError) as e:
            bob.get_weights(layer.module_id)
        assert e.value.code == "NOT_FOUND"
        with pytest.raises(gradwire.GradwireError) as e:
            anonymous.list_modules()
        assert e.value.code == "UNAUTHENTICATED"
    finally:
        alice.close()
        bob.close()
        anonymous.close()
