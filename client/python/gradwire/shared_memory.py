"""Shared-memory tensors for a client on the server's host.

``Client.forward`` and ``Client.backward`` use them by themselves (``Client(shared_memory=
"auto")``, the default): a call whose tensors reach ``shared_memory_min_kib`` asks the server for
a region (``CreateSharedMemory``: the server makes a POSIX shared-memory object readable by its
own user only, under a random name, and hands it to this client alone), opens and maps it, removes
its name so that no other process can open it, and from then on writes requests into it and reads
results out of it. A server on another host, in another container or under another user, or one
started with ``--shared-memory off``, cannot give this process a region it can open: the client
then uses the wire, without an error. ``SameHostRegion`` is that region.

A server started with ``--allow-shared-memory`` also takes objects a client makes and names
itself. ``SharedMemoryRegion`` creates such an object, registers it with the server and lays
tensors out in it; ``Client.forward_shared`` / ``Client.backward_shared`` run calls through
one::

    with SharedMemoryRegion(client, 64 << 20) as region:
        y, ctx, _ = client.forward_shared(module_id, x, training=True, region=region)
        dx = client.backward_shared(ctx, dy, region=region)

Keys start with the server's ``--shared-memory-prefix`` ("gradwire" by default). The object is
readable and writable by this user only; it is unregistered and removed on ``close()``.
"""

import logging
import mmap
import os
import secrets
import stat
import threading
import time
from multiprocessing import shared_memory
from typing import List, Optional, Tuple

import grpc
import torch

from gradwire import wire
from gradwire.v1 import tensor_pb2


log = logging.getLogger("gradwire")


class _RegionIO:
    """Tensors in and out of a mapped region: ``buffer``, ``name`` and ``size`` come from the
    subclass."""

    name: str
    size: int

    @property
    def buffer(self) -> memoryview:
        raise NotImplementedError

    def write(self, offset: int, t: torch.Tensor, dtype: int,
              block: int = 0) -> tensor_pb2.Tensor:
        """Encodes ``t`` as proto dtype ``dtype`` at ``offset`` (FP8 with block scales of
        1 x ``block`` when ``block`` > 0, ``wire.encode``); returns the request tensor that
        references it."""
        return self.write_encoded(offset, wire.encode(t, dtype, block))

    def write_encoded(self, offset: int, encoded: "wire.Encoded") -> tensor_pb2.Tensor:
        """``write`` of a tensor already encoded (``wire.encode``, ``wire.encode_exact_input``,
        ``wire.encode_exact_block_input``). The region gets its bytes (for a block-scaled FP8
        tensor the codes, both copies with a columnwise one, which ``byte_size`` counts); the
        returned header keeps dtype, shape and scales (scale_inv, or the block scales)."""
        msg, data = encoded
        n = data.nbytes
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{n} bytes at offset {offset} do not fit the {self.size}-byte "
                             f"region {self.name}")
        self.buffer[offset:offset + n] = data  # the one copy: from the tensor's memory
        msg.shared_memory.CopyFrom(self.ref(offset, n))
        return msg

    def ref(self, offset: int, byte_size: int) -> tensor_pb2.SharedMemoryRef:
        """Bytes [offset, offset + byte_size) of this region: where a result should go. A range
        outside the region raises ValueError before anything is sent."""
        if offset < 0 or byte_size < 0 or offset + byte_size > self.size:
            raise ValueError(f"{byte_size} bytes at offset {offset} do not fit the {self.size}-byte "
                             f"region {self.name}")
        return tensor_pb2.SharedMemoryRef(region=self.name, offset=offset, byte_size=byte_size)

    def read(self, header: tensor_pb2.Tensor) -> torch.Tensor:
        """The float32 tensor a response's ``header`` says the server wrote here (or carries
        inline)."""
        if not header.HasField("shared_memory"):
            return wire.decode(header, header.data)
        ref = header.shared_memory
        if ref.region != self.name:
            raise ValueError(f"the tensor does not lie in region {self.name}")
        if ref.offset + ref.byte_size > self.size:
            raise ValueError(f"the tensor's bytes lie outside the {self.size}-byte region")
        # Decoded from the region in place (an F32 tensor is one copy of it: the region is
        # written again by later calls).
        return wire.decode(header, self.buffer[ref.offset:ref.offset + ref.byte_size])


class SameHostRegion(_RegionIO):
    """A region the server made for this client (``CreateSharedMemory``), mapped here; its
    object's name is removed as soon as it is open. Raises ``OSError`` when this process cannot
    open it (another host, container or user than the server's): the region is unregistered
    again. ``close()`` unmaps it and unregisters it."""

    def __init__(self, client, size: int):
        from gradwire.v1 import service_pb2
        made = client._call("CreateSharedMemory",
                            service_pb2.CreateSharedMemoryRequest(byte_size=size))
        self.name = made.region
        self.size = made.byte_size
        self.idle_timeout_s = made.idle_timeout_s
        self._client = client
        self._map: Optional[mmap.mmap] = None
        try:
            if (self.size < size or not made.key.startswith("/") or "/" in made.key[1:]
                    or made.key in ("/", "/.", "/..")):
                raise OSError(f"the server's answer does not describe a {size}-byte region")
            path = "/dev/shm" + made.key
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                # Whatever happens next, the name goes: nobody else may open it after us.
                os.unlink(path)
                st = os.fstat(fd)
                if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                        or st.st_mode & 0o077 or st.st_size < self.size):
                    raise OSError(f"{made.key} is not a {self.size}-byte object of this user "
                                  "only")
                self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                                      mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except BaseException:
            self._unregister()
            raise
        self._view = memoryview(self._map)

    @property
    def buffer(self) -> memoryview:
        return self._view

    def _unregister(self) -> bool:
        """Best effort within a second (a server that cannot answer closes the region itself
        once it has gone unused for --shared-memory-idle); False when the server did not
        answer."""
        from gradwire.v1 import service_pb2
        try:
            self._client._stub.UnregisterSharedMemory(
                service_pb2.UnregisterSharedMemoryRequest(name=self.name),
                timeout=min(1.0, self._client.timeout), metadata=self._client._metadata()[0])
        except grpc.RpcError as e:
            log.debug("unregistering shared-memory region %s: %s", self.name, e.code())
            return e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED)
        return True

    def close(self, unregister: bool = True) -> bool:
        """Unmaps the region and, with ``unregister``, unregisters it; False when the server did
        not answer."""
        if self._map is None:
            return True
        self._view.release()
        self._map.close()
        self._map = None
        return self._unregister() if unregister else True


class _SharedPool:
    """The regions one ``Client`` passes its large tensors through: made on first need, each
    lent to one call at a time, grown when a call needs more, dropped when the server closed
    them. A server that cannot give this client a region it can open turns the pool off for the
    client's life; a refusal that may pass (the server's limits) sends calls over the wire for a
    few seconds before the next try."""

    MAX_REGIONS = 8
    MIN_BYTES = 1 << 20
    LASTING = ("FAILED_PRECONDITION", "UNIMPLEMENTED", "PERMISSION_DENIED")

    def __init__(self, client):
        self._client = client
        self._lock = threading.Lock()
        self._idle: List[Tuple[SameHostRegion, float]] = []
        self._lent = 0
        self._retry_after = 0.0
        self.off = False
        self.made = 0

    def acquire(self, nbytes: int) -> Optional[SameHostRegion]:
        """A region of at least ``nbytes`` for one call (give it back with ``release`` or
        ``drop``), or None: the wire."""
        discard = []
        with self._lock:
            now = time.monotonic()
            if self.off or now < self._retry_after:
                return None
            keep = []
            for region, since in self._idle:
                t = region.idle_timeout_s
                # Unused for most of the server's idle timeout: it may be closed there already.
                (discard if t > 0 and now - since > 0.8 * t else keep).append((region, since))
            self._idle = keep
            fits = [i for i, (r, _) in enumerate(self._idle) if r.size >= nbytes]
            if fits:
                i = min(fits, key=lambda i: self._idle[i][0].size)
                region = self._idle.pop(i)[0]
                self._lent += 1
                chosen = region
            else:
                chosen = None
                if self._lent + len(self._idle) >= self.MAX_REGIONS:
                    if not self._idle:
                        return None
                    i = min(range(len(self._idle)), key=lambda i: self._idle[i][0].size)
                    discard.append(self._idle.pop(i))
                self._lent += 1
        for region, _ in discard:
            region.close()
        if chosen is not None:
            return chosen
        size = self.MIN_BYTES
        while size < nbytes:
            size <<= 1
        try:
            region = SameHostRegion(self._client, size)
        except Exception as e:
            from gradwire.client import GradwireError
            with self._lock:
                self._lent -= 1
                if not isinstance(e, GradwireError) or e.code in self.LASTING:
                    if not self.off:
                        log.debug("tensors to %s go over the wire: %s", self._client.server, e)
                    self.off = True
                else:
                    self._retry_after = time.monotonic() + 5.0
            return None
        with self._lock:
            self.made += 1
        return region

    def release(self, region: SameHostRegion) -> None:
        with self._lock:
            self._lent -= 1
            self._idle.append((region, time.monotonic()))

    def drop(self, region: SameHostRegion) -> None:
        """The server no longer has ``region``: discard it."""
        with self._lock:
            self._lent -= 1
        region.close()

    def close(self, unregister: bool = True) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self.off = True
        answered = unregister
        for region, _ in idle:
            # A server that did not answer once is not asked again: close() stays short.
            answered = region.close(unregister=answered) and answered


class SharedMemoryRegion(_RegionIO):
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
