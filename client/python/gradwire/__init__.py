"""gradwire for PyTorch users: remote FP8 modules that behave like local ``torch.nn.Module``s.

The generated protocol stubs (``gradwire.v1``) are built from ``proto/`` by the project's build
into ``build/python``; put both ``client/python`` and ``build/python`` on ``PYTHONPATH``.
"""

# The generated gradwire.v1 package lives in the build tree: let it join this package.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

from gradwire.client import Client, GradwireError  # noqa: E402
from gradwire.modules import (  # noqa: E402
    RemoteLayerNormLinear,
    RemoteLayerNormMLP,
    RemoteLinear,
    RemoteModule,
)

__all__ = [
    "Client",
    "GradwireError",
    "RemoteModule",
    "RemoteLinear",
    "RemoteLayerNormLinear",
    "RemoteLayerNormMLP",
]
