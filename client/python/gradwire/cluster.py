"""Several gradwire servers behind one interface, as the C++ ``Cluster``: each module is placed
on one server (explicitly, or round-robin), and every call about it, or about a context one of
its forwards made, goes to that server, so a backward always reaches the saved tensors of its
forward.

A module id may name its server as ``"host:port/module_id"``; a bare id is found where this
cluster created it, or else by asking every server.
"""

import itertools
import threading
from typing import Dict, List, Optional, Sequence

from gradwire.client import Client, GradwireError
from gradwire.v1 import module_pb2


class Cluster:
    """One ``Client`` per server address; ``client_args`` (timeout, wire_dtype, token, TLS, ...)
    go to each. Use it as a context manager, or call ``close()``."""

    def __init__(self, servers: Sequence[str], **client_args):
        if not servers:
            raise ValueError("a cluster needs at least one server")
        if len(set(servers)) != len(servers):
            raise ValueError(f"a server is named twice in {list(servers)}")
        self.clients: List[Client] = [Client(s, **client_args) for s in servers]
        self._placed: Dict[str, int] = {}
        self._next = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.clients)

    def close(self, keep: bool = False) -> None:
        """Closes every client: each deletes the modules it owns unless ``keep``."""
        for c in self.clients:
            c.close(keep=keep)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create_module(self, spec: module_pb2.ModuleSpec,
                      where: Optional[int] = None) -> module_pb2.ModuleInfo:
        """Creates the module on server ``where`` (0-based), or on the next one in turn."""
        if where is None:
            where = next(self._next) % len(self.clients)
        if not 0 <= where < len(self.clients):
            raise ValueError(f"where must be in [0, {len(self.clients)}), got {where}")
        info = self.clients[where].create_module(spec)
        with self._lock:
            self._placed[info.module_id] = where
        return info

    def qualified_id(self, module_id: str) -> str:
        """``"host:port/module_id"``: the id with the server that holds it."""
        return f"{self.client_for(module_id).server}/{module_id.rsplit('/', 1)[-1]}"

    def locate(self, module_id: str) -> int:
        """Index of the server holding ``module_id``; NOT_FOUND when none does."""
        if "/" in module_id:
            server, bare = module_id.rsplit("/", 1)
            for i, c in enumerate(self.clients):
                if c.server == server:
                    with self._lock:
                        self._placed[bare] = i
                    return i
            raise GradwireError("Locate", "NOT_FOUND", f"{server} is not a server of this cluster")
        with self._lock:
            if module_id in self._placed:
                return self._placed[module_id]
        for i, c in enumerate(self.clients):
            if any(m.module_id == module_id for m in c.list_modules()):
                with self._lock:
                    self._placed[module_id] = i
                return i
        raise GradwireError("Locate", "NOT_FOUND",
                            f"module_id {module_id} is on none of {len(self.clients)} servers")

    def client_for(self, module_id: str) -> Client:
        """The client of the server that holds ``module_id``."""
        return self.clients[self.locate(module_id)]
