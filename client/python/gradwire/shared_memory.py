"""Shared-memory tensors for a client on the server's host.

A server started with ``--allow-shared-memory`` reads request tensors from, and writes results
into, POSIX shared-memory objects that its clients register, instead of moving their bytes
through gRPC. ``SharedMemoryRegion`` creates such an object, registers it with the server and
lays tensors out in it; ``Client.forward_shared`` / ``Client.backward_shared`` run calls through
one::

    with SharedMemoryRegion(client, 64 << 20) as region:
        y, ctx, _ = client.forward_shared(module_id, x, training=True, region=region)
        dx = client.backward_shared(ctx, dy, region=region)

Keys start with the server's ``--shared-memory-prefix`` ("gradwire" by default). The object is
readable and writable by this user only; it is unregistered and removed on ``close()``.
"""

import os
import secrets
from multiprocessing import shared_memory
from typing import Optional

import torch

from gradwire import wire
from gradwire.v1 import tensor_pb2


class SharedMemoryRegion:
    """A shared-memory object of ``size`` bytes, created here and registered with ``client``'s
    server under ``name`` (default: its key). Use as a context manager, or call ``close()``."""

    def __init__(self, client, size: int, name: Optional[str] = None, prefix: str = "gradwire"):
        if size <= 0:
            raise ValueError("a shared-memory region needs size > 0")
        key = f"{prefix}-{os.getpid()}-{secrets.token_hex(8)}"
        self._shm = shared_memory.SharedMemory(name=key, create=True, size=size)
        self.key = "/" + key
        self.name = name or key
        self.size = size
        self._client = client
        try:
            client.register_shared_memory(self.name, self.key, 0, size)
        except BaseException:
            self._shm.close()
            self._shm.unlink()
            raise
        self._registered = True

    @property
    def buffer(self) -> memoryview:
        return self._shm.buf

    def write(self, offset: int, t: torch.Tensor, dtype: int) -> tensor_pb2.Tensor:
        """Encodes ``t`` as proto dtype ``dtype`` at ``offset``; returns the request tensor that
        references it."""
        msg, data = wire.encode(t, dtype)
        n = data.nbytes
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{n} bytes at offset {offset} do not fit the {self.size}-byte "
                             f"region {self.name}")
        self._shm.buf[offset:offset + n] = data  # the one copy: from the tensor's memory
        msg.shared_memory.CopyFrom(self.ref(offset, n))
        return msg

    def ref(self, offset: int, byte_size: int) -> tensor_pb2.SharedMemoryRef:
        """Bytes [offset, offset + byte_size) of this region: where a result should go."""
        return tensor_pb2.SharedMemoryRef(region=self.name, offset=offset, byte_size=byte_size)

    def read(self, header: tensor_pb2.Tensor) -> torch.Tensor:
        """The float32 tensor a response's ``header`` says the server wrote here."""
        ref = header.shared_memory
        if not header.HasField("shared_memory") or ref.region != self.name:
            raise ValueError(f"the tensor does not lie in region {self.name}")
        if ref.offset + ref.byte_size > self.size:
            raise ValueError(f"the tensor's bytes lie outside the {self.size}-byte region")
        # Decoded from the region in place (an F32 tensor is one copy of it: the region is
        # written again by later calls).
        return wire.decode(header, self._shm.buf[ref.offset:ref.offset + ref.byte_size])

    def close(self) -> None:
        """Unregisters the region (if the server still holds it) and removes the object."""
        if self._shm is None:
            return
        try:
            if self._registered:
                self._registered = False
                self._client.unregister_shared_memory(self.name)
        finally:
            self._shm.close()
            self._shm.unlink()
            self._shm = None

    def __enter__(self) -> "SharedMemoryRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
