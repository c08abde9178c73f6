"""gradwire for PyTorch users: remote FP8 modules that behave like local ``torch.nn.Module``s.

``RemoteLinear``, ``RemoteLayerNormLinear`` and ``RemoteLayerNormMLP`` run forward and backward
on a gradwire server; ``RemoteSequential`` mixes them with local modules and pipelines
micro-batches through them; ``Client`` (one server) and ``Cluster`` (several) connect.

How they behave as modules -- each point is explained where it is implemented:

- parameters: real ``nn.Parameter``s with the server's names and shapes, a lazily kept mirror
  of the server's weights; ``state_dict()`` / ``load_state_dict()`` move the real weights
  (``gradwire.modules``);
- optimizers: ``optimizer="local"`` (default) lets any torch optimizer train a remote module
  (gradients arrive in ``.grad``; a ``step()`` is pushed to the server before the next forward);
  ``optimizer="sgd"`` / ``"adamw"`` step on the server, with ``ServerOptimizer`` for LR
  schedulers (``gradwire.optim``);
- deadlines: every call, Train-stream requests included, fails with DEADLINE_EXCEEDED naming
  the call after ``Client(timeout=...)`` seconds (``gradwire.client``,
  ``gradwire.train_stream``);
- lifetimes: ``module.delete()``, ``with module:``, and ``Client.close()`` deleting what its
  modules created unless ``keep=True``;
- autograd: ``retain_graph=True`` keeps the server's context for another backward;
- copies: ``copy.deepcopy`` / ``pickle`` make a new module from the weights (pickle needs an open
  client to the same server); TorchScript is refused with a clear error;
- dtypes: outputs in the input's dtype and device, 16-bit inputs travel as such, autocast is
  honoured, non-float inputs are refused;
- logging: the ``"gradwire"`` logger, one DEBUG line per call.

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
from gradwire.optim import ServerOptimizer, pull, push  # noqa: E402
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
    "ServerOptimizer",
    "SharedMemoryRegion",
    "TrainStream",
    "is_loopback",
    "pull",
    "push",
]
