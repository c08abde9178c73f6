"""gradwire for PyTorch users: remote FP8 modules that behave like local ``torch.nn.Module``s.

Install with ``pip install ./client/python`` (no build step: the protocol stubs are part of the
package). See README.md next to this package.
"""

__version__ = "0.1.0"  # the project version (CMakeLists.txt); tests check they agree

from gradwire.client import Client, ContextLostError, GradwireError, is_loopback  # noqa: E402
from gradwire.cluster import Cluster  # noqa: E402
from gradwire.modules import (  # noqa: E402
    RemoteLayerNormLinear,
    RemoteLayerNormMLP,
    RemoteLinear,
    RemoteModule,
)
from gradwire.sequential import RemoteSequential  # noqa: E402
from gradwire.shared_memory import SharedMemoryRegion  # noqa: E402
from gradwire.train_stream import TrainStream  # noqa: E402

__all__ = [
    "__version__",
    "Client",
    "Cluster",
    "ContextLostError",
    "GradwireError",
    "RemoteModule",
    "RemoteLinear",
    "RemoteLayerNormLinear",
    "RemoteLayerNormMLP",
    "RemoteSequential",
    "SharedMemoryRegion",
    "TrainStream",
    "is_loopback",
]
