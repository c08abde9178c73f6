"""The Python client of gradwire-server (gRPC): one connection, every call with a deadline.

Deadlines: every unary and chunked call carries ``Client.timeout``; so does every request on the
``Train`` stream (see ``gradwire.train_stream``). A call that passes its deadline raises
``GradwireError`` with ``code == "DEADLINE_EXCEEDED"`` and ``method`` naming the call.

Lifetimes: the modules a ``RemoteModule`` creates through a client are *owned* by that client
(unless created with ``keep=True``). ``Client.close()`` deletes every owned module that is still
on the server, then ends the Train stream and the connection; ``close(keep=True)`` leaves them.

Logging: the ``"gradwire"`` logger writes one DEBUG line per call (method, module or context,
milliseconds, and the call's ``traceparent``) and WARNING lines for what cleanup could not do.

Requests you can follow: every call sends a W3C ``traceparent``; the server uses its trace-id as
the call's request id, in its log lines about the call and at the end of an error's message
(``[request ID]``). ``GradwireError.request_id`` holds it on this side.
"""

import collections
import ipaddress
import logging
import os
import re
import secrets
import socket
import threading
import time
import weakref
from typing import (TYPE_CHECKING, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple,
                    Union)

import grpc
import numpy as np
import torch

from gradwire import kinds, tensor_messages, wire
from gradwire.tensor_messages import Outgoing, Path, Received
from gradwire.v1 import module_pb2, service_pb2, service_pb2_grpc

if TYPE_CHECKING:
    from gradwire.train_stream import TrainStream

ForwardResult = Tuple[torch.Tensor, str, Optional[torch.Tensor]]


class _GradOutput(NamedTuple):
    """A backward's grad_output encoded for the wire (``Client._grad_output_form``): its
    ``encoded`` tensor, the ``column_sums`` that go beside it (float32, or None) and whether it is
    the exact wire's FP8 cast (``exact``)."""

    encoded: wire.Encoded
    column_sums: Optional[np.ndarray]
    exact: bool


log = logging.getLogger("gradwire")

# The metadata header naming the module a call is about: a proxy in front of several servers
# routes each module's calls to one of them by it (docs/scaling-out.md). The client sends it on
# every call about a module; the server refuses a call about another module than it names.
ROUTE_HEADER = "gradwire-route"
log.addHandler(logging.NullHandler())  # a library leaves the handlers to the application

_SERVICE = service_pb2.DESCRIPTOR.services_by_name["Gradwire"]

# Open clients, newest last: unpickling a remote module looks here for a connection to its server
# (a pickle never carries a connection, a token or key material).
_OPEN_CLIENTS: "List[weakref.ref]" = []
_OPEN_LOCK = threading.Lock()


def open_client_for(server: str) -> Optional["Client"]:
    """The most recently opened, still open ``Client`` to ``server`` in this process, if any."""
    with _OPEN_LOCK:
        for ref in reversed(_OPEN_CLIENTS):
            c = ref()
            if c is not None and not c.closed and c.server == server:
                return c
    return None


_TRACE_ID = re.compile(r"[0-9a-f]{32}")

# The first and the largest wait, in milliseconds, before the connection tries the server again
# after losing it (see Client's channel options).
_RECONNECT_BACKOFF_MS = (100, 500)
RECONNECT_BACKOFF_MAX_S = _RECONNECT_BACKOFF_MS[1] / 1000.0


def new_traceparent(trace_id: Optional[str] = None) -> str:
    """A W3C ``traceparent`` (version 00, sampled): ``trace_id`` (32 lowercase hex digits) when
    given, else a fresh random trace-id, and a fresh random parent id."""
    if trace_id is None:
        trace_id = "0" * 32
        while trace_id == "0" * 32:
            trace_id = secrets.token_hex(16)
    parent = "0" * 16
    while parent == "0" * 16:
        parent = secrets.token_hex(8)
    return f"00-{trace_id}-{parent}-01"


# Codes of a refusal of the request itself: a forward refused so ran nothing on the server, or
# made no context (RESOURCE_EXHAUSTED comes before the compute, or from a store that kept nothing).
_REFUSED = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION",
                      "PERMISSION_DENIED", "UNAUTHENTICATED", "OUT_OF_RANGE", "UNIMPLEMENTED",
                      "RESOURCE_EXHAUSTED"})


def _may_have_run(error: BaseException) -> bool:
    """Whether a forward that raised ``error`` may have run on the server: it ended without
    the server's answer (cancelled, a deadline, the transport, an interrupt), or with an answer
    given after the compute."""
    return not (isinstance(error, GradwireError) and error.code in _REFUSED)


class GradwireError(RuntimeError):
    """A call the server refused or could not serve: ``code`` is the gRPC status code name
    ("NOT_FOUND", "INVALID_ARGUMENT", ...), ``message`` the server's explanation, and
    ``request_id`` the call's request id (the trace-id of the ``traceparent`` it was sent with;
    the server's log lines about the call carry it), or None."""

    def __init__(self, method: str, code: str, message: str, request_id: Optional[str] = None):
        super().__init__(f"{method}: {code}: {message}")
        self.method = method
        self.code = code
        self.message = message
        self.request_id = request_id


class ContextLostError(GradwireError):
    """A backward whose saved tensors the server no longer holds. ``reason`` says why:

    - ``"ttl"``: unused for longer than the server's context TTL (``--context-ttl``);
    - ``"memory"``: evicted because context memory was full;
    - ``"undelivered"``: the forward's response never reached this client, so the server
      dropped the context;
    - ``"stream_ended"``: the Train stream that made it ended first;
    - ``"module_moved"``: the module moved to another server (behind a proxy, another server
      sharing the checkpoint directory took it over) and contexts do not move with it;
    - ``"server_restarted"``: the server process that made the context is gone: the server
      restarted (its instance id changed), or, behind a proxy, it left and the module moved to
      the server that answered;
    - ``"server_unavailable"``: the server cannot be reached;
    - ``"unknown"``: the server does not know the context (never made here, or released).

    Run the forward again, or create the module with ``recompute_on_lost_context=True``.
    """

    def __init__(self, method: str, code: str, message: str, reason: str,
                 request_id: Optional[str] = None):
        super().__init__(method, code, message, request_id)
        self.reason = reason


def _lost_reason(message: str) -> str:
    if "context TTL" in message:
        return "ttl"
    if "context memory was full" in message:
        return "memory"
    if "never reached the client" in message:
        return "undelivered"
    if "stream" in message and "ended" in message:
        return "stream_ended"
    if "its module moved to another server" in message:
        return "module_moved"
    if "came to this server process from its checkpoint" in message:
        return "server_restarted"
    return "unknown"


def is_loopback(server: str) -> bool:
    """True when ``server`` ("host:port", "[v6]:port", "unix:path") names this machine only."""
    if server.startswith("unix:") or server.startswith("unix-abstract:"):
        return True
    host = server
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_port(server: str) -> Optional[Tuple[str, int]]:
    """(host, port) of a "host:port" or "[v6]:port" address; None for unix sockets or no port."""
    if server.startswith("unix"):
        return None
    if server.startswith("["):
        host, _, rest = server[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = server.rpartition(":")
    return (host, int(port)) if port.isdigit() else None


def _returns_layernorm(spec: module_pb2.ModuleSpec) -> bool:
    """Whether a forward of ``spec``'s module also returns its LayerNorm output."""
    return spec.return_layernorm_output and kinds.reads(spec.kind, "return_layernorm_output")


def _read(path: Optional[str], what: str) -> Optional[bytes]:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror}") from None


def _keep_alive(ref: "weakref.ref", stop: threading.Event) -> None:
    """A client's keep-alive thread: learns the server's module TTL, then renews the client's
    held modules every third of it. Holds the client only weakly, and ends with it."""
    ttl = None
    while not stop.is_set():
        c = ref()
        if c is None or c.closed:
            return
        if ttl is None:
            try:
                ttl = c._stub.GetServerInfo(service_pb2.GetServerInfoRequest(),
                                            timeout=min(10.0, c.timeout),
                                            metadata=c._metadata()[0]).module_ttl_s
            except grpc.RpcError:
                del c
                stop.wait(10.0)  # asked again later
                continue
            if ttl <= 0:
                return  # no TTL on this server: nothing to renew
        period = max(ttl / 3.0, 0.05)
        del c
        if stop.wait(period):
            return
        c = ref()
        if c is None or c.closed:
            return
        with c._keeper_lock:
            ids = sorted(c._held)
        # One call per module, routed by its id: behind a proxy the modules may live on
        # different servers.
        for module_id in ids:
            try:
                resp = c._stub.KeepAlive(service_pb2.KeepAliveRequest(module_ids=[module_id]),
                                         timeout=min(period, c.timeout),
                                         metadata=c._metadata(module_id)[0])
            except grpc.RpcError as e:
                log.debug("KeepAlive of %s to %s: %s", module_id, c.server, e.code())
                continue
            finally:
                c.keep_alive_calls += 1
            for gone in resp.unknown:
                log.warning("module %s is no longer on %s", gone, c.server)
                c.release(gone)


class Client:
    """Connection to one gradwire-server. Every call has a deadline of ``timeout`` seconds,
    requests on the Train stream included.

    Use it as a context manager, or call ``close()``: closing deletes the modules this client's
    ``RemoteModule``s created (unless they were made with ``keep=True``, or ``close(keep=True)``).

    Args:
        server: "host:port" of the server.
        timeout: deadline of each call, in seconds: a unary call, a chunked call, or one request
            on the Train stream. Past it the call raises ``GradwireError`` with code
            ``DEADLINE_EXCEEDED`` naming the call (a Train-stream request also replaces the
            stream).
        wire_dtype: how activations and gradients travel. "exact" (the default) changes no
            result: every tensor travels as "f32" does, except a forward's input to a module
            that casts it to E4M3 first in a way the client repeats bit for bit (a Linear under
            CURRENT with margin 0, BLOCK or MXFP8), which travels as the server's own cast of
            it: codes and scale_inv under CURRENT (a quarter of the bytes), codes and block
            scales under BLOCK and MXFP8, with the columnwise copy in a training forward (half
            the bytes; a quarter in inference); and a backward's grad_output, for every kind,
            as the module's own FP8 cast of it (E5M2 under CURRENT; E4M3, or E5M2 under the
            HYBRID format, with block scales and the columnwise copy under BLOCK; E4M3 so under
            MXFP8) with its column sums for a module with a bias, where the server sums bias
            gradients in row order (``exact_grad_output``). A tensor that is not all finite (or
            a gradient whose column sum overflows) travels as itself. The results are "f32"'s,
            bit for bit. "f32": every tensor as float32.
            Lossy, one dtype both ways: "bf16", "f16" (halve the bytes), or "fp8" (a quarter:
            E4M3 activations and E5M2 gradients, each tensor with a current-scaling scale of its
            own, or for a module under BLOCK or MXFP8 with block scales of 1 x 128 / 1 x 32
            along each row; the server uses FP8 input codes as they are). With "exact" and
            "f32", a bfloat16 or float16 tensor travels in its own dtype (it loses nothing).
        max_message_mib: largest message sent or received.
        token: bearer token for a server that requires tokens (default: the ``GRADWIRE_TOKEN``
            environment variable, if set).
        chunk_kib: tensors larger than this travel on the chunked calls (at most the server's
            ``--chunk-kib``).
        chunking: "auto" (by the request's and the expected response's size), "always" or
            "never".
        tls_ca: PEM bundle of the CA that signed the server's certificate; turns TLS on.
        tls_cert: this client's PEM certificate, for a server that requires mutual TLS.
        tls_key: the private key of ``tls_cert``.
        tls_server_name: the name the server's certificate must carry when it is not the host
            of ``server``.
        insecure: allow plaintext to an address that is not loopback. Without TLS, a token or
            a tensor would cross the network in the clear, so this is refused by default (as
            the server refuses to listen in plaintext on a public address).
        trace_id: 32 lowercase hex digits: the trace-id of the ``traceparent`` every call sends
            (one trace over many calls). None: a fresh trace-id per call, so each call has a
            request id of its own in the server's logs.
        shared_memory: "auto": a forward or backward whose tensors reach
            ``shared_memory_min_kib`` passes them through a shared-memory region the server
            makes for this client alone, when the server is on this host and this process can
            open it (``gradwire.shared_memory``); otherwise, and with "off", the wire.
        shared_memory_min_kib: the smallest call (its tensors in and out together) that goes
            through shared memory.
    """

    def __init__(self, server: str = "127.0.0.1:50051", timeout: float = 30.0,
                 wire_dtype: str = "exact", max_message_mib: int = 64,
                 token: Optional[str] = None, chunk_kib: int = 4096, chunking: str = "auto",
                 tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, tls_server_name: Optional[str] = None,
                 insecure: bool = False, trace_id: Optional[str] = None,
                 shared_memory: str = "auto", shared_memory_min_kib: int = 64):
        if chunking not in ("auto", "always", "never"):
            raise ValueError("chunking must be 'auto', 'always' or 'never'")
        if shared_memory not in ("auto", "off"):
            raise ValueError("shared_memory must be 'auto' or 'off'")
        if not isinstance(shared_memory_min_kib, int) or shared_memory_min_kib < 0:
            raise ValueError("shared_memory_min_kib must be a whole number >= 0")
        if wire_dtype not in wire.WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(wire.WIRE_DTYPES)}")
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("tls_cert and tls_key go together (mutual TLS needs both)")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if trace_id is not None and (not _TRACE_ID.fullmatch(trace_id) or trace_id == "0" * 32):
            raise ValueError("trace_id must be 32 lowercase hex digits, not all zero")
        self.trace_id = trace_id
        tls = bool(tls_ca or tls_cert)
        if not tls and not insecure and not is_loopback(server):
            raise ValueError(
                f"refusing plaintext to {server}, which is not a loopback address: give tls_ca "
                "(TLS) or insecure=True (tensors and tokens would cross the network in clear)")
        self.chunk_bytes = chunk_kib << 10
        self.chunking = chunking
        self.chunked_calls = 0
        self._modules: Dict[str, module_pb2.ModuleSpec] = {}  # to predict response sizes
        # ModuleInfo.row_order_bias_sums by module, beside its spec: whether the exact wire may
        # send grad_output of a module with a bias as its FP8 cast with column sums.
        self._row_order_bias_sums: Dict[str, bool] = {}
        # Backwards whose grad_output crossed as its FP8 cast under the exact wire (unary,
        # chunked, shared memory and the Train stream; tests, benchmarks).
        self.exact_fp8_gradients = 0
        self.server = server
        self.timeout = float(timeout)
        self.wire_dtype = wire_dtype
        self.activation_dtype, self.gradient_dtype = wire.WIRE_DTYPES[wire_dtype]
        self._tls = tls
        self._mutual_tls = bool(tls_cert)
        if token is None:
            token = os.environ.get("GRADWIRE_TOKEN") or None
        self._auth = (("authorization", "Bearer " + token),) if token else ()
        limit = max_message_mib << 20
        options = [("grpc.max_send_message_length", limit),
                   ("grpc.max_receive_message_length", limit),
                   # gRPC's own reconnect backoff grows to minutes (1 s, then 1.6 times more
                   # after each failed attempt), so a server that restarted would stay
                   # unreachable from here for seconds after it listens again. Bounded, a
                   # restarted server is reached within RECONNECT_BACKOFF_MAX_S.
                   ("grpc.initial_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS[0]),
                   ("grpc.min_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS[0]),
                   ("grpc.max_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS[1])]
        if tls:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca, "tls_ca"),
                private_key=_read(tls_key, "tls_key"),
                certificate_chain=_read(tls_cert, "tls_cert"))
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(server, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(server, options=options)
        self._stub = service_pb2_grpc.GradwireStub(self._channel)
        # The same methods with the encoding done here (see gradwire.tensor_messages): they take
        # a request's bytes, and answer a Received for responses that carry tensors.
        self._raw_calls: Dict[str, object] = {}
        # The server process each module's forwards ran on, by module (behind a proxy, the
        # modules of one client live in several server processes), and under "" the first one
        # (for a context whose module this client no longer knows).
        self._instance_ids: "collections.OrderedDict[str, str]" = collections.OrderedDict()
        # Train streams by route (None: the unrouted one), opened on first use.
        self._trains: Dict[Optional[str], "TrainStream"] = {}
        self._train_lock = threading.Lock()
        # The latest weight version the server reported per module (forward responses,
        # ApplyGradients, Get/SetWeights): how a module knows its local mirror is stale.
        self.weight_versions: Dict[str, int] = {}
        # Modules this client deletes on close(), in creation order, with a weak reference to
        # the module object (marked deleted then). Reentrant: a module's finalizer, run by the
        # garbage collector, may come in while this thread holds the lock.
        self._owned: Dict[str, Optional[weakref.ref]] = {}
        self._owned_lock = threading.RLock()
        self._closed = False
        # Modules kept alive on a server with --module-ttl (hold), and the thread that does it.
        self._held: set = set()
        self._keeper: Optional[threading.Thread] = None
        self._keeper_stop = threading.Event()
        self._keeper_lock = threading.Lock()
        self.keep_alive_calls = 0
        from gradwire.shared_memory import _SharedPool
        self._shm = _SharedPool(self)
        self._shm.off = shared_memory == "off"
        self._shm_min = shared_memory_min_kib << 10
        # ReleaseContext calls sent for training forwards that ended without their answer, and
        # those still in flight.
        self.unanswered_releases = 0
        self._releases: set = set()
        self._release_lock = threading.Lock()
        self.shared_memory_calls = 0  # forwards and backwards whose tensors went through it
        # Which module made each training context of this client's forwards (newest last,
        # bounded): a backward's grad_input size, for a shared-memory backward.
        self._context_modules: "collections.OrderedDict[str, str]" = collections.OrderedDict()
        with _OPEN_LOCK:
            _OPEN_CLIENTS[:] = [r for r in _OPEN_CLIENTS if r() is not None and not r().closed]
            _OPEN_CLIENTS.append(weakref.ref(self))
        log.debug("client for %s: wire %s, timeout %g s, %s", server, wire_dtype, self.timeout,
                  "mutual TLS" if tls_cert else "TLS" if tls else "plaintext")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._owned)} owned modules"
        return f"gradwire.Client({self.server!r}, wire_dtype={self.wire_dtype!r}, {state})"

    def __reduce__(self):
        raise TypeError("a gradwire.Client cannot be pickled or copied: it holds a connection "
                        "(and perhaps a token); open a new Client in the other process")

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran."""
        return self._closed

    def owned_modules(self) -> List[str]:
        """Ids of the modules this client will delete on ``close()``."""
        with self._owned_lock:
            return list(self._owned)

    def own(self, module_id: str, module=None) -> None:
        """Makes ``module_id`` one this client deletes on ``close()`` (what a ``RemoteModule``
        that created its module does). ``module``: the Python object holding it, kept weakly."""
        with self._owned_lock:
            self._owned[module_id] = weakref.ref(module) if module is not None else None

    def context_route(self, context_id: str, consume: bool) -> Optional[str]:
        """The module a training context belongs to (None when this client did not make it),
        which routes its backward. ``consume``: the caller's backward consumes the context, so
        the client forgets it."""
        if consume:
            return self._context_modules.pop(context_id, None)
        return self._context_modules.get(context_id)

    def _disown(self, module_id: str) -> None:
        with self._owned_lock:
            self._owned.pop(module_id, None)

    def close(self, keep: bool = False) -> None:
        """Deletes the modules this client owns (those its ``RemoteModule``s created without
        ``keep=True``) unless ``keep``, then ends the Train stream, if any, and the connection.
        A module that cannot be deleted (server unreachable) is logged as a warning. Closing
        twice does nothing."""
        if self._closed:
            return
        # One timeout in all: a server that stalls costs the first call that waits on it, and
        # what follows only gets the time that is left.
        deadline = time.monotonic() + self.timeout
        self._keeper_stop.set()
        with self._owned_lock:
            owned, self._owned = self._owned, {}
        for i, (module_id, ref) in enumerate(owned.items()):
            if keep:
                break
            try:
                self.delete_module(module_id)
            except GradwireError as e:
                if e.code in ("DEADLINE_EXCEEDED", "UNAVAILABLE"):
                    # The server cannot answer: one deadline, not one per module.
                    log.warning("could not delete %d modules on %s at close (%s): %s",
                                len(owned) - i, self.server, e, ", ".join(list(owned)[i:]))
                    break
                if e.code != "NOT_FOUND":
                    log.warning("could not delete module %s on %s at close: %s", module_id,
                                self.server, e)
                    continue
            module = ref() if ref is not None else None
            if module is not None:
                module._deleted = True
        with self._train_lock:
            streams = list(self._trains.values())
            self._trains.clear()
        for stream in streams:
            stream.close(wait=max(0.0, deadline - time.monotonic()))
        self._shm.close(unregister=time.monotonic() < deadline)
        with self._release_lock:
            releases = list(self._releases)
        for future in releases:  # background releases of unanswered forwards, within the deadline
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001: best effort; the context TTL is the backstop
                pass
        self._closed = True
        self._channel.close()
        log.debug("client for %s closed", self.server)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- errors

    def _error(self, method: str, e: grpc.RpcError,
               traceparent: Optional[str] = None) -> "GradwireError":
        """The GradwireError of a failed call, with a hint where gRPC's own words are vague."""
        code, details = e.code().name, e.details() or ""
        request_id = traceparent.split("-")[1] if traceparent else None
        if code == "DEADLINE_EXCEEDED":
            details = f"{details} (no answer within {self.timeout:g} s from {self.server})"
        elif code == "UNAVAILABLE":
            details = f"{details} ({self.connection_hint()})"
        if request_id and request_id not in details:
            # The server ends its errors with the id; one it never answered gets it here.
            details = f"{details} [request {request_id}]"
        return GradwireError(method, code, details, request_id)

    def connection_hint(self) -> str:
        """What to check when the server cannot be reached: whether the address names a port,
        whether anything listens there, whether a server answers there now (one that restarted
        after this connection's last attempt), and which TLS settings fit a server that does."""
        where = _host_port(self.server)
        if where is None and not self.server.startswith("unix"):
            return (f"{self.server!r} names no port, and gRPC then tries port 443: give "
                    "\"host:port\" (gradwire-server listens where its --listen says, e.g. "
                    "127.0.0.1:50051)")
        if where is not None:
            try:
                socket.create_connection(where, timeout=min(self.timeout, 2.0)).close()
            except OSError as e:
                return (f"nothing accepts connections at {self.server} ({e.strerror or e}): "
                        "is gradwire-server running there?")
        if not self._tls:
            if self._answers_plaintext():
                return (f"gradwire-server answers at {self.server} now, but this connection "
                        "found nothing there at its last attempt (the server restarted?); it "
                        f"tries again within {RECONNECT_BACKOFF_MAX_S:g} s: retry the call")
            return (f"{self.server} accepts connections but the call failed: server expects "
                    "TLS? give tls_ca= (and tls_cert=/tls_key= for mutual TLS)")
        if not self._mutual_tls:
            return ("TLS failed: client certificate required? (a server with --tls-client-ca "
                    "needs tls_cert= and tls_key=); or tls_ca is not the CA of the server's "
                    "certificate, or the certificate does not name the host (tls_server_name=)")
        return ("TLS failed: is tls_cert signed by the CA the server trusts (--tls-client-ca), "
                "tls_ca the CA of the server's certificate, and the host named in it "
                "(tls_server_name=)? or does the server not serve TLS at all?")

    def _answers_plaintext(self) -> bool:
        """Whether a gRPC call on a fresh plaintext connection to the server gets an answer
        (any answer but UNAVAILABLE: a refusal of the token is an answer too)."""
        channel = grpc.insecure_channel(self.server)
        try:
            service_pb2_grpc.GradwireStub(channel).GetServerInfo(
                service_pb2.GetServerInfoRequest(), timeout=min(self.timeout, 2.0),
                metadata=self._metadata()[0])
            return True
        except grpc.RpcError as e:
            return e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED)
        finally:
            channel.close()

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise GradwireError(method, "CANCELLED", f"the client to {self.server} is closed")

    def _raw(self, method: str):
        """``method`` as a callable that sends requests already encoded (bytes, as
        ``Outgoing.SerializeToString()`` writes them: a tensor's bytes copied once, into the
        message gRPC sends) and parses responses with ``tensor_messages.reader`` (the tensors'
        bytes left in the received message)."""
        call = self._raw_calls.get(method)
        if call is None:
            desc = _SERVICE.methods_by_name[method]
            make = {(False, False): self._channel.unary_unary,
                    (False, True): self._channel.unary_stream,
                    (True, False): self._channel.stream_unary,
                    (True, True): self._channel.stream_stream}[
                        (desc.client_streaming, desc.server_streaming)]
            call = make(f"/{_SERVICE.full_name}/{method}", request_serializer=None,
                        response_deserializer=tensor_messages.reader(
                            getattr(service_pb2, desc.output_type.name)))
            self._raw_calls[method] = call
        return call

    def _call(self, method: str, request, about: str = "", raw: bool = False,
              route: Optional[str] = None):
        """Calls a unary method. ``raw``: through ``_raw`` (``request`` a message, an
        ``Outgoing``, or its encoding; a response that carries tensors comes back as a
        Received). ``route``: the module the call is about (its ``gradwire-route`` header)."""
        self._check_open(method)
        metadata, traceparent = self._metadata(route)
        start = time.perf_counter()
        try:
            if raw:
                payload = request if isinstance(request, bytes) else request.SerializeToString()
                response = self._raw(method)(payload, timeout=self.timeout, metadata=metadata)
            else:
                response = getattr(self._stub, method)(request, timeout=self.timeout,
                                                       metadata=metadata)
        except grpc.RpcError as e:
            error = self._error(method, e, traceparent)
            log.debug("%s %s: %s after %.1f ms (traceparent %s)", method, about, error.code,
                      1e3 * (time.perf_counter() - start), traceparent)
            raise error from None
        log.debug("%s %s: %.1f ms (traceparent %s)", method, about,
                  1e3 * (time.perf_counter() - start), traceparent)
        return response

    def _metadata(self, route: Optional[str] = None
                  ) -> Tuple[Tuple[Tuple[str, str], ...], str]:
        """The metadata of one call (the token, a fresh ``traceparent``, and with ``route`` the
        ``gradwire-route`` header naming the module the call is about) and its traceparent."""
        traceparent = new_traceparent(self.trace_id)
        metadata = self._auth + (("traceparent", traceparent),)
        # Only what a header can carry (printable ASCII): an id a caller passed in may be
        # anything; such a call goes without the header and the server names what is wrong.
        if route and len(route) <= 256 and route.isprintable() and route.isascii():
            metadata += ((ROUTE_HEADER, route),)
        return metadata, traceparent

    def _use_chunked(self, request_bytes: int, response_bytes: int = 0) -> bool:
        if self.chunking != "auto":
            return self.chunking == "always"
        return request_bytes > self.chunk_bytes or response_bytes > self.chunk_bytes

    def _chunked(self, method: str, request: Outgoing, part_type, response_type=None,
                 route: Optional[str] = None):
        """Calls a chunked method: ``request``'s message as the header (its tensors' data
        empty), then its tensors' bytes in chunks, each chunk's message written around a slice
        of the tensor's memory; returns the reassembled response as a Received (or the single
        response of SetWeightsChunked)."""
        self._check_open(method)
        self.chunked_calls += 1
        metadata, traceparent = self._metadata(route)
        start = time.perf_counter()
        try:
            result = self._raw(method)(chunked_parts(request, part_type, self.chunk_bytes),
                                       timeout=self.timeout, metadata=metadata)
            if response_type is not None:
                result = _assemble(method, result, response_type)
        except grpc.RpcError as e:
            log.debug("%s: failed (traceparent %s)", method, traceparent)
            raise self._error(method, e, traceparent) from None
        log.debug("%s: %d bytes, %.1f ms (traceparent %s)", method, request.nbytes,
                  1e3 * (time.perf_counter() - start), traceparent)
        return result

    def _spec(self, module_id: str) -> Optional[module_pb2.ModuleSpec]:
        if module_id not in self._modules:
            try:
                self.module_info(module_id)  # asks the module's server (routed by its id)
            except GradwireError:
                pass
        return self._modules.get(module_id)

    def _remember(self, info: module_pb2.ModuleInfo) -> None:
        """Keeps what the client needs of a module's ModuleInfo: its spec, and whether its
        server sums bias-gradient columns in row order (``row_order_bias_sums``)."""
        self._modules[info.module_id] = info.spec
        self._row_order_bias_sums[info.module_id] = info.row_order_bias_sums

    def _seen(self, module_id: str, weight_version: int) -> None:
        if weight_version:
            self.weight_versions[module_id] = int(weight_version)

    # --- server and modules

    def server_info(self, route: Optional[str] = None) -> service_pb2.GetServerInfoResponse:
        """Version, device, module kinds, modules and live contexts of the server. ``route``: a
        module id, so that behind a proxy the answer comes from the server holding it."""
        return self._call("GetServerInfo", service_pb2.GetServerInfoRequest(), route=route)

    def instance_id(self, route: Optional[str] = None) -> str:
        """The server process's instance id (a new one after every restart); ``route`` as for
        ``server_info``."""
        return self.server_info(route).instance_id

    def create_module(self, spec: module_pb2.ModuleSpec) -> module_pb2.ModuleInfo:
        """Creates a module from ``spec`` (the raw call: the module is not owned, so nothing
        deletes it but ``delete_module``; ``RemoteModule`` and its kinds own what they create)."""
        # The id is chosen here, so that the call is routed as every later one about the module.
        module_id = secrets.token_hex(16)
        info = self._call("CreateModule",
                          service_pb2.CreateModuleRequest(spec=spec, module_id=module_id),
                          module_pb2.ModuleKind.Name(spec.kind), route=module_id).module
        self._remember(info)
        self._seen(info.module_id, info.weight_version)
        self.hold(info.module_id)
        log.debug("created module %s on %s", info.module_id, self.server)
        return info

    def hold(self, module_id: str) -> None:
        """Keeps ``module_id`` alive on a server with ``--module-ttl`` while this client is open
        (a ``KeepAlive`` every third of the TTL, from a thread of its own), until
        ``delete_module`` or ``release``. Modules this client creates are held from the start;
        a ``RemoteModule`` holds the module it attaches to."""
        with self._keeper_lock:
            self._held.add(module_id)
            if self._keeper is None and not self._closed:
                self._keeper = threading.Thread(
                    target=_keep_alive, args=(weakref.ref(self), self._keeper_stop),
                    name="gradwire-keepalive", daemon=True)
                self._keeper.start()

    def release(self, module_id: str) -> None:
        """Stops keeping ``module_id`` alive: the server's ``--module-ttl`` decides from here."""
        with self._keeper_lock:
            self._held.discard(module_id)

    def held(self) -> List[str]:
        """The modules this client keeps alive."""
        with self._keeper_lock:
            return sorted(self._held)

    def list_modules(self) -> List[module_pb2.ModuleInfo]:
        """The modules on the server this client may see (its tenant's, with tokens)."""
        modules = list(self._call("ListModules", service_pb2.ListModulesRequest()).modules)
        for m in modules:
            self._remember(m)
        return modules

    def module_info(self, module_id: str) -> module_pb2.ModuleInfo:
        """ListModules' entry for ``module_id``; NOT_FOUND when the server has no such module.
        The ListModules is routed by ``module_id``: behind a proxy it asks the module's server."""
        modules = list(self._call("ListModules", service_pb2.ListModulesRequest(),
                                  route=module_id).modules)
        for m in modules:
            self._remember(m)
        for m in modules:
            if m.module_id == module_id:
                return m
        raise GradwireError("ListModules", "NOT_FOUND", f"module_id {module_id} is not on "
                            f"{self.server}")

    def delete_module(self, module_id: str) -> None:
        """Deletes the module and everything it holds on the server (weights, gradients,
        optimizer state, its contexts)."""
        self._call("DeleteModule", service_pb2.DeleteModuleRequest(module_id=module_id),
                   module_id, route=module_id)
        self._modules.pop(module_id, None)
        self._row_order_bias_sums.pop(module_id, None)
        self.weight_versions.pop(module_id, None)
        self._disown(module_id)
        self.release(module_id)
        log.debug("deleted module %s on %s", module_id, self.server)

    # --- forward and backward

    def forward_request(self, module_id: str, x: torch.Tensor, training: bool,
                        dtype: Optional[int] = None, context_id: str = "") -> Outgoing:
        """The ForwardRequest of ``x``: it travels, and the output comes back, as ``dtype``
        (a proto DType; default: this client's activation wire dtype). An ``Outgoing``: the
        message's fields read through it, the input's bytes stay in the encoded tensor's
        memory (``x``'s own when it is contiguous CPU float32, or in the wire's 16-bit dtype)
        until the request is serialized, and ``to_message()`` gives the whole message.
        ``context_id``: the id a training forward's context takes (32 random hex digits;
        empty: the server draws one)."""
        dtype = self.activation_dtype if dtype is None else dtype
        header, data = self._encode_input(module_id, x, dtype, training)
        return Outgoing(service_pb2.ForwardRequest(
            module_id=module_id, input=header, training=training, output_dtype=dtype,
            context_id=context_id), {_FORWARD_INPUT: data})

    def exact_fp8_input(self, module_id: str) -> bool:
        """Whether this client's forwards send ``module_id``'s input as E4M3 codes: the wire is
        "exact" and the module's spec allows it (``gradwire.kinds.exact_fp8_input``; the spec is
        asked of the server once when this client has not seen the module). Under BLOCK and
        MXFP8 the codes come with block scales (``fp8_block``)."""
        if self.wire_dtype != "exact":
            return False
        spec = self._spec(module_id)
        return spec is not None and kinds.exact_fp8_input(spec)

    def fp8_block(self, module_id: Optional[str]) -> int:
        """The block length FP8 tensors to and from ``module_id`` are scaled in: 128 under the
        BLOCK recipe, 32 under MXFP8 (``gradwire.kinds.block_size``), 0 (one scale per tensor)
        under the others and for a module whose spec the client cannot learn."""
        if not module_id:
            return 0
        spec = self._spec(module_id)
        return kinds.block_size(spec) if spec is not None else 0

    def _encode_input(self, module_id: str, x: torch.Tensor, dtype: int,
                      training: bool) -> wire.Encoded:
        """A forward's input as it travels when the output travels as ``dtype``: under the
        exact wire, the server's own E4M3 cast of it when the module takes that (and ``dtype``
        is a full-precision one: F32, or the caller's BF16 / F16): one scale under CURRENT, block
        scales under BLOCK and MXFP8, with the columnwise copy in ``training``; else ``x`` as
        ``dtype`` (FP8 with the module's block scales under BLOCK and MXFP8)."""
        if dtype in (wire.F32, wire.BF16, wire.F16):
            if self.exact_fp8_input(module_id):
                block = self.fp8_block(module_id)
                encoded = (wire.encode_exact_block_input(x, block, training) if block
                           else wire.encode_exact_input(x))
                if encoded is not None:
                    return encoded
            return wire.encode(x, dtype)
        return wire.encode(x, dtype, self._wire_block(module_id, dtype))

    def _wire_block(self, module_id: Optional[str], dtype: int) -> int:
        """The block length a tensor sent as ``dtype`` to ``module_id`` takes: the module's
        (``fp8_block``) for an FP8 dtype, else 0."""
        return self.fp8_block(module_id) if dtype in (wire.FP8_E4M3, wire.FP8_E5M2) else 0

    def _input_bytes(self, module_id: str, x: torch.Tensor, dtype: int, training: bool) -> int:
        """The bytes of codes or values ``_encode_input`` makes of ``x``, without encoding it
        (a non-finite input, which travels as itself, is counted as codes)."""
        if dtype in (wire.F32, wire.BF16, wire.F16) and self.exact_fp8_input(module_id):
            # E4M3 codes; under BLOCK and MXFP8 a training forward's columnwise copy too.
            return x.numel() * (2 if training and self.fp8_block(module_id) else 1)
        return x.numel() * wire.element_size(dtype)

    def exact_grad_output(self, module_id: Optional[str]) -> Optional[int]:
        """The FP8 dtype (``wire.FP8_E4M3`` or ``wire.FP8_E5M2``) in which this client's
        backwards send ``module_id``'s grad_output, or None (as the gradient dtype): the wire is
        "exact" and the module's spec and server allow it (``gradwire.kinds.exact_grad_output``:
        a module with a bias only from a server with ``ModuleInfo.row_order_bias_sums``; the spec
        is asked of the server once when this client has not seen the module). Under BLOCK and
        MXFP8 the codes come with block scales (``fp8_block``) and the columnwise copy; with a
        bias, the column sums go beside them."""
        if self.wire_dtype != "exact" or not module_id:
            return None
        spec = self._spec(module_id)
        if spec is None:
            return None
        return kinds.exact_grad_output(spec, self._row_order_bias_sums.get(module_id, False))

    def _grad_output_form(self, module_id: Optional[str], grad_output: torch.Tensor,
                          dtype: int) -> _GradOutput:
        """A backward's grad_output as it travels when grad_input comes back as ``dtype``:
        under the exact wire, the module's own FP8 cast of it with its column sums (a module
        with a bias) where the module takes that (``exact_grad_output``) and ``dtype`` is a
        full-precision one (F32, or the caller's BF16 / F16, whose values are cast as float32);
        else ``grad_output`` as ``dtype`` (FP8 with the module's block scales under BLOCK and
        MXFP8). A grad_output that is not all finite, or whose column sums overflow, travels as
        itself: the server answers it as on the F32 wire."""
        if dtype in (wire.F32, wire.BF16, wire.F16):
            form = self.exact_grad_output(module_id)
            spec = self._modules.get(module_id) if form is not None else None
            if spec is not None and grad_output.dim() > 0 and \
                    grad_output.shape[-1] == spec.out_features:
                exact = wire.encode_exact_gradient(grad_output, form, kinds.block_size(spec),
                                                   spec.bias)
                if exact is not None:
                    return _GradOutput(exact.encoded, exact.column_sums, True)
            return _GradOutput(wire.encode(grad_output, dtype), None, False)
        return _GradOutput(wire.encode(grad_output, dtype, self._wire_block(module_id, dtype)),
                           None, False)

    def backward_request(self, context_id: str, grad_output: torch.Tensor,
                         skip_grad_input: bool = False, retain: bool = False,
                         grad_layernorm_output: Optional[torch.Tensor] = None,
                         dtype: Optional[int] = None,
                         module_id: Optional[str] = None, *,
                         _form: Optional[_GradOutput] = None) -> Outgoing:
        """The BackwardRequest of ``grad_output``: it travels, and grad_input comes back, as
        ``dtype`` (default: this client's gradient wire dtype), except that under the exact
        wire grad_output travels as the module's FP8 cast of it where the module takes that,
        with its column sums for a module with a bias (``exact_grad_output``). An
        ``Outgoing``, as ``forward_request`` makes. ``module_id``: the context's module
        (default: the one this client's forward made the context for), whose recipe says
        whether FP8 gradients carry block scales. ``_form``: grad_output already encoded
        (``_grad_output_form``)."""
        dtype = self.gradient_dtype if dtype is None else dtype
        if module_id is None:
            module_id = self._context_modules.get(context_id)
        form = _form if _form is not None else self._grad_output_form(module_id, grad_output,
                                                                       dtype)
        header, data = form.encoded
        req = Outgoing(service_pb2.BackwardRequest(
            context_id=context_id, grad_output=header, retain=retain,
            skip_grad_input=skip_grad_input, grad_input_dtype=dtype), {_GRAD_OUTPUT: data})
        if form.column_sums is not None:
            req.message.grad_output_column_sums.extend(form.column_sums.tolist())
        if grad_layernorm_output is not None:
            header, data = wire.encode(grad_layernorm_output, dtype,
                                       self._wire_block(module_id, dtype))
            req.message.grad_layernorm_output.CopyFrom(header)
            req.data[_GRAD_LAYERNORM_OUTPUT] = data
        return req

    @staticmethod
    def forward_result(resp: Union[Received, service_pb2.ForwardResponse]) -> ForwardResult:
        """(output, context_id or "", layernorm_output or None) of a ForwardResponse (a whole
        message, or a Received whose tensors' bytes lie in the received message)."""
        if not isinstance(resp, Received):
            resp = Received(resp, {_OUTPUT: resp.output.data,
                                   _LAYERNORM_OUTPUT: resp.layernorm_output.data})
        msg = resp.message
        ln = _decode(resp, "layernorm_output") if msg.HasField("layernorm_output") else None
        return _decode(resp, "output"), msg.context_id, ln

    def _note_instance(self, context_id: str, module_id: str) -> None:
        """Remembers, at a module's first training forward, which server process holds it."""
        if not context_id or module_id in self._instance_ids:
            return
        try:
            self._instance_ids[module_id] = self.instance_id(module_id)
        except GradwireError:
            return
        self._instance_ids.setdefault("", self._instance_ids[module_id])
        while len(self._instance_ids) > 65536:
            self._instance_ids.popitem(last=False)

    def wire_dtypes_for(self, dtype: torch.dtype) -> Tuple[int, int]:
        """(activation, gradient) wire dtypes for a tensor of ``dtype``: this client's, except
        that with "exact" and "f32" a bfloat16 or float16 tensor travels as itself (halving the
        bytes and losing nothing)."""
        if self.wire_dtype in ("exact", "f32") and dtype in (torch.bfloat16, torch.float16):
            d = wire.BF16 if dtype == torch.bfloat16 else wire.F16
            return d, d
        return self.activation_dtype, self.gradient_dtype

    def forward(self, module_id: str, x: torch.Tensor, training: bool,
                dtype: Optional[int] = None) -> ForwardResult:
        """Returns (output, context_id or "", layernorm_output or None); float32 CPU tensors.
        ``dtype``: the wire dtype of input and output (default: the client's).

        A training forward names its context itself (128 random bits). When the call ends
        without the server's answer (cancelled, past the timeout, the connection lost), or
        with one that cannot be read, the server may hold a context whose id nobody learnt:
        the client then releases it in the background."""
        if not training:
            return self._forward_named(module_id, x, False, dtype, "", [])
        context_id = secrets.token_hex(16)
        answered: List[bool] = []
        try:
            return self._forward_named(module_id, x, True, dtype, context_id, answered)
        except BaseException as e:
            if answered or _may_have_run(e):
                self._release_in_background(context_id, module_id)
            raise

    def _release_in_background(self, context_id: str, module_id: str) -> None:
        """One ReleaseContext of ``context_id`` (of ``module_id``) with a short deadline, not
        waited for (close waits for those still in flight, within its own deadline)."""
        if self._closed:
            return
        metadata, _ = self._metadata(module_id)
        try:
            future = self._stub.ReleaseContext.future(
                service_pb2.ReleaseContextRequest(context_id=context_id),
                timeout=min(self.timeout, 2.0), metadata=metadata)
        except ValueError:  # the channel closed meanwhile
            return
        self.unanswered_releases += 1
        with self._release_lock:
            self._releases.add(future)
        future.add_done_callback(self._release_done)

    def _release_done(self, future) -> None:
        with self._release_lock:
            self._releases.discard(future)

    def _forward_named(self, module_id: str, x: torch.Tensor, training: bool,
                       dtype: Optional[int], context_id: str,
                       answered: List[bool]) -> ForwardResult:
        """``forward`` with the context's id chosen; appends to ``answered`` once the server's
        OK answer arrived."""
        if not self._shm.off and x.dim() > 0 and x.shape[-1] > 0:
            result = self._forward_shared_auto(module_id, x, training, dtype, context_id,
                                               answered)
            if result is not None:
                return result
        req = self.forward_request(module_id, x, training, dtype, context_id)
        size = wire.element_size(req.output_dtype)
        sent = req.nbytes
        out_bytes = 0
        if self.chunking == "auto" and not self._use_chunked(sent) and x.dim() > 0:
            spec = self._spec(module_id)
            if spec is not None:
                rows = x.numel() // max(1, x.shape[-1])
                width = spec.out_features + (spec.in_features if _returns_layernorm(spec)
                                             else 0)
                out_bytes = rows * width * size
        if self._use_chunked(sent, out_bytes):
            resp = self._chunked("ForwardChunked", req, service_pb2.ForwardRequestPart,
                                 service_pb2.ForwardResponse, route=module_id)
        else:
            resp = self._call("Forward", req, module_id, raw=True, route=module_id)
        answered.append(True)
        self._seen(module_id, resp.message.weight_version)
        result = self.forward_result(resp)
        self._note_instance(result[1], module_id)
        self._note_context(result[1], module_id)
        return result

    def _note_context(self, context_id: str, module_id: str) -> None:
        if not context_id:
            return
        self._context_modules[context_id] = module_id
        while len(self._context_modules) > 65536:
            self._context_modules.popitem(last=False)

    def lost_context(self, error: GradwireError,
                     module_id: Optional[str] = None) -> GradwireError:
        """The error a failed backward should raise: a ContextLostError with its reason when the
        context is gone, else ``error`` itself. ``module_id``: the context's module, whose server
        process is asked whether it restarted."""
        if isinstance(error, ContextLostError):
            return error
        if error.code == "UNAVAILABLE":
            return ContextLostError(error.method, error.code, error.message, "server_unavailable",
                                    error.request_id)
        if error.code != "NOT_FOUND" or "context_id" not in error.message:
            return error
        reason = _lost_reason(error.message)
        known = self._instance_ids.get(module_id or "")
        if reason == "unknown" and known is not None:
            try:
                if self.instance_id(module_id) != known:
                    reason = "server_restarted"
            except GradwireError:
                reason = "server_unavailable"
        return ContextLostError(error.method, error.code, error.message, reason, error.request_id)

    def backward(self, context_id: str, grad_output: torch.Tensor, skip_grad_input: bool = False,
                 retain: bool = False, grad_layernorm_output: Optional[torch.Tensor] = None,
                 dtype: Optional[int] = None) -> Optional[torch.Tensor]:
        """Returns grad_input (None with skip_grad_input), a float32 CPU tensor. ``retain``
        keeps the context for another backward. Raises ContextLostError when the server no
        longer holds the context."""
        module_id = (self._context_modules.pop(context_id, None) if not retain
                     else self._context_modules.get(context_id))
        try:
            return self._backward_to(module_id, context_id, grad_output, skip_grad_input, retain,
                                     grad_layernorm_output, dtype)
        except GradwireError:
            # Not consumed: a retry goes where the context lives (behind a proxy, routed).
            if module_id is not None and not retain:
                self._note_context(context_id, module_id)
            raise

    def _backward_to(self, module_id: Optional[str], context_id: str, grad_output: torch.Tensor,
                     skip_grad_input: bool, retain: bool,
                     grad_layernorm_output: Optional[torch.Tensor],
                     dtype: Optional[int]) -> Optional[torch.Tensor]:
        dtype = self.gradient_dtype if dtype is None else dtype
        # Encoded once, for shared memory or the wire.
        form = self._grad_output_form(module_id, grad_output, dtype)
        if form.exact:
            self.exact_fp8_gradients += 1
        if not self._shm.off and module_id is not None:
            done, grad_input = self._backward_shared_auto(
                context_id, module_id, form, grad_output, skip_grad_input, retain,
                grad_layernorm_output, dtype)
            if done:
                return grad_input
        req = self.backward_request(context_id, grad_output, skip_grad_input, retain,
                                    grad_layernorm_output, dtype, module_id, _form=form)
        sent = req.nbytes
        # grad_input's bytes where the module is known (grad_output's own may be FP8 codes);
        # else as many as the request's.
        back = 0 if skip_grad_input else self._grad_input_bytes(
            module_id, grad_output, wire.element_size(dtype))
        try:
            if self._use_chunked(sent, sent if back is None else back):
                resp = self._chunked("BackwardChunked", req, service_pb2.BackwardRequestPart,
                                     service_pb2.BackwardResponse, route=module_id)
            else:
                resp = self._call("Backward", req, context_id, raw=True, route=module_id)
        except GradwireError as e:
            raise self.lost_context(e, module_id) from None
        return _decode(resp, "grad_input") if resp.message.HasField("grad_input") else None

    # --- shared-memory tensors

    @staticmethod
    def _aligned(n: int) -> int:
        return (n + 63) & ~63

    def _shared_call(self, method: str, req, about: str, region, route: Optional[str]):
        """A unary call whose tensors lie in ``region``: its response, or None when the server
        no longer has the region (closed after --shared-memory-idle; refused before anything
        was read or run, so the call can go over the wire), which is then dropped."""
        try:
            resp = self._call(method, req, about, route=route)
        except GradwireError as e:
            if e.code == "NOT_FOUND" and region.name in e.message:
                self._shm.drop(region)
                return None
            raise
        self.shared_memory_calls += 1
        return resp

    def _forward_shared_auto(self, module_id: str, x: torch.Tensor, training: bool,
                             dtype: Optional[int], context_id: str = "",
                             answered: Optional[List[bool]] = None) -> Optional[ForwardResult]:
        """``forward`` through the client's shared-memory pool, or None for the wire (too
        small, no region, or the server had closed the one lent)."""
        spec = self._spec(module_id)
        if spec is None:
            return None
        dtype = self.activation_dtype if dtype is None else dtype
        size = wire.element_size(dtype)
        rows = x.numel() // x.shape[-1]
        # The input's bytes as it will travel (E4M3 under the exact wire for a module that takes
        # it, with the columnwise copy of a training forward under BLOCK and MXFP8, as its
        # encoding below says for sure), to decide before encoding anything.
        in_bytes = self._input_bytes(module_id, x, dtype, training)
        out_bytes = rows * spec.out_features * size
        ln = _returns_layernorm(spec)
        ln_bytes = rows * spec.in_features * size if ln else 0
        if in_bytes + out_bytes + ln_bytes < self._shm_min:
            return None
        encoded = self._encode_input(module_id, x, dtype, training)
        in_bytes = encoded.data.nbytes
        at_out = self._aligned(in_bytes)
        at_ln = at_out + self._aligned(out_bytes)
        region = self._shm.acquire(at_ln + ln_bytes)
        if region is None:
            return None
        try:
            req = service_pb2.ForwardRequest(module_id=module_id, training=training,
                                             output_dtype=dtype, context_id=context_id)
            req.input.CopyFrom(region.write_encoded(0, encoded))
            req.output_shared_memory.CopyFrom(region.ref(at_out, out_bytes))
            if ln:
                req.layernorm_output_shared_memory.CopyFrom(region.ref(at_ln, ln_bytes))
            resp = self._shared_call("Forward", req, module_id, region, module_id)
            if resp is None:
                region = None  # dropped: the wire
                return None
            if answered is not None:
                answered.append(True)
            self._seen(module_id, resp.weight_version)
            out = region.read(resp.output)
            ln_out = region.read(resp.layernorm_output) if resp.HasField("layernorm_output") \
                else None
        finally:
            if region is not None:
                self._shm.release(region)
        self._note_instance(resp.context_id, module_id)
        self._note_context(resp.context_id, module_id)
        return out, resp.context_id, ln_out

    def _backward_shared_auto(self, context_id: str, module_id: str, form: _GradOutput,
                              grad_output: torch.Tensor, skip_grad_input: bool, retain: bool,
                              grad_layernorm_output: Optional[torch.Tensor],
                              dtype: int) -> Tuple[bool, Optional[torch.Tensor]]:
        """``backward`` through the pool: (True, grad_input), or (False, None) for the wire.
        ``form``: grad_output encoded (``_grad_output_form``). grad_input has grad_output's rows
        and the module's in_features: its size is known for a context one of this client's
        forwards made."""
        size = wire.element_size(dtype)
        block = self._wire_block(module_id, dtype)
        go_bytes = form.encoded.data.nbytes
        gln_bytes = grad_layernorm_output.numel() * size \
            if grad_layernorm_output is not None else 0
        gi_bytes = 0 if skip_grad_input else self._grad_input_bytes(module_id, grad_output, size)
        if gi_bytes is None or go_bytes + gln_bytes + gi_bytes < self._shm_min:
            return False, None
        at_gln = self._aligned(go_bytes)
        at_gi = at_gln + self._aligned(gln_bytes)
        region = self._shm.acquire(at_gi + max(gi_bytes, 1))
        if region is None:
            return False, None
        try:
            req = service_pb2.BackwardRequest(context_id=context_id, retain=retain,
                                              skip_grad_input=skip_grad_input,
                                              grad_input_dtype=dtype)
            req.grad_output.CopyFrom(region.write_encoded(0, form.encoded))
            if form.column_sums is not None:
                req.grad_output_column_sums.extend(form.column_sums.tolist())
            if grad_layernorm_output is not None:
                req.grad_layernorm_output.CopyFrom(
                    region.write(at_gln, grad_layernorm_output, dtype, block))
            if gi_bytes:
                req.grad_input_shared_memory.CopyFrom(region.ref(at_gi, gi_bytes))
            try:
                resp = self._shared_call("Backward", req, context_id, region, module_id)
            except GradwireError as e:
                raise self.lost_context(e, module_id) from None
            if resp is None:
                region = None  # dropped: the wire
                return False, None
            return True, region.read(resp.grad_input) if resp.HasField("grad_input") else None
        finally:
            if region is not None:
                self._shm.release(region)

    def _grad_input_bytes(self, module_id: str, grad_output: torch.Tensor,
                          size: int) -> Optional[int]:
        """grad_input's bytes for a backward through ``module_id``: grad_output's rows times its
        in_features."""
        spec = self._modules.get(module_id)
        if spec is None or grad_output.dim() == 0 or grad_output.shape[-1] == 0:
            return None
        rows = grad_output.numel() // grad_output.shape[-1]
        return rows * spec.in_features * size

    # --- shared-memory regions a client makes (a server on this host with
    # --allow-shared-memory)

    def register_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Registers bytes [offset, offset + byte_size) of the POSIX shared-memory object ``key``
        as region ``name``. ``gradwire.shared_memory.SharedMemoryRegion`` does it for you."""
        self._call("RegisterSharedMemory", service_pb2.RegisterSharedMemoryRequest(
            name=name, key=key, offset=offset, byte_size=byte_size), name)

    def unregister_shared_memory(self, name: str = "") -> int:
        """Unregisters region ``name``, or every region of this caller when empty; returns how
        many were."""
        return self._call("UnregisterSharedMemory",
                          service_pb2.UnregisterSharedMemoryRequest(name=name),
                          name).unregistered

    def list_shared_memory(self, name: str = "") -> list:
        """The shared-memory regions of this caller (or the one named)."""
        return list(self._call("ListSharedMemory",
                               service_pb2.ListSharedMemoryRequest(name=name)).regions)

    def forward_shared(self, module_id: str, x: torch.Tensor, training: bool, region,
                       offset: int = 0) -> ForwardResult:
        """``forward`` with its tensors in ``region`` (a SharedMemoryRegion) instead of on the
        wire: ``x`` is written at ``offset`` and the outputs after it."""
        spec = self._spec(module_id)
        if spec is None:
            raise ValueError(f"unknown module {module_id}")
        size = wire.element_size(self.activation_dtype)
        rows = x.numel() // max(1, x.shape[-1]) if x.dim() > 0 else 0
        req = service_pb2.ForwardRequest(module_id=module_id, training=training,
                                         output_dtype=self.activation_dtype)
        req.input.CopyFrom(region.write_encoded(
            offset, self._encode_input(module_id, x, self.activation_dtype, training)))
        at = offset + req.input.shared_memory.byte_size
        out_bytes = rows * spec.out_features * size
        req.output_shared_memory.CopyFrom(region.ref(at, out_bytes))
        if _returns_layernorm(spec):
            req.layernorm_output_shared_memory.CopyFrom(
                region.ref(at + out_bytes, rows * spec.in_features * size))
        resp = self._call("Forward", req, module_id, route=module_id)
        self._seen(module_id, resp.weight_version)
        ln = region.read(resp.layernorm_output) if resp.HasField("layernorm_output") else None
        self._note_instance(resp.context_id, module_id)
        self._note_context(resp.context_id, module_id)
        return region.read(resp.output), resp.context_id, ln

    def backward_shared(self, context_id: str, grad_output: torch.Tensor, region,
                        offset: int = 0, skip_grad_input: bool = False,
                        retain: bool = False) -> Optional[torch.Tensor]:
        """``backward`` with grad_output written into ``region`` at ``offset`` and grad_input
        written by the server after it (its size is grad_output's rows times in_features, at
        most the rest of the region)."""
        req = service_pb2.BackwardRequest(context_id=context_id, retain=retain,
                                          skip_grad_input=skip_grad_input,
                                          grad_input_dtype=self.gradient_dtype)
        module_id = self._context_modules.get(context_id)
        # Under the exact wire, the module's FP8 cast of it where it takes that.
        form = self._grad_output_form(module_id, grad_output, self.gradient_dtype)
        if form.exact:
            self.exact_fp8_gradients += 1
        req.grad_output.CopyFrom(region.write_encoded(offset, form.encoded))
        if form.column_sums is not None:
            req.grad_output_column_sums.extend(form.column_sums.tolist())
        if not skip_grad_input:
            at = offset + req.grad_output.shared_memory.byte_size
            req.grad_input_shared_memory.CopyFrom(region.ref(at, region.size - at))
        try:
            resp = self._call("Backward", req, context_id, route=module_id)
        except GradwireError as e:
            raise self.lost_context(e, module_id) from None
        return region.read(resp.grad_input) if resp.HasField("grad_input") else None

    def release_context(self, context_id: str) -> None:
        """Drops a training context without a backward."""
        self._call("ReleaseContext", service_pb2.ReleaseContextRequest(context_id=context_id),
                   context_id, route=self._context_modules.pop(context_id, None))

    def train_stream(self, route: Optional[str] = None) -> "TrainStream":
        """This client's Train stream (opened on first use, and again after one ended or was
        replaced): forwards and backwards of several micro-batches in flight at once on one
        call, each request with its own deadline. ``route``: a module id: the stream for that
        module's requests only (forwards of it, backwards of its contexts), sent with its
        ``gradwire-route`` header, so that a routing proxy keeps it on the module's server; one
        is open per module used. None: one stream for any module (a direct connection)."""
        from gradwire.train_stream import TrainStream
        self._check_open("Train")
        with self._train_lock:
            stream = self._trains.get(route)
            if stream is None or stream.closed:
                stream = self._trains[route] = TrainStream(self, route)
            return stream

    # --- optimizer and weights

    def apply_gradients(self, module_id: str, learning_rate: float = 0.0) -> int:
        """One step of the module's server optimizer on its accumulated gradients, which it then
        zeroes; ``learning_rate`` > 0 overrides the configured rate for this step. Returns the
        new weight version."""
        version = self._call("ApplyGradients", service_pb2.ApplyGradientsRequest(
            module_id=module_id, learning_rate=learning_rate), module_id,
            route=module_id).weight_version
        self._seen(module_id, version)
        return version

    def get_weights(self, module_id: str, dtype: int = wire.F32) -> Dict[str, torch.Tensor]:
        """The module's parameters by name ("weight", "bias", "layer_norm_weight", "fc1_weight",
        ...), decoded to float32 CPU tensors; ``dtype`` is how they travel (a proto DType)."""
        return self.get_weights_versioned(module_id, dtype)[0]

    def get_weights_versioned(self, module_id: str, dtype: int = wire.F32
                              ) -> Tuple[Dict[str, torch.Tensor], int]:
        """``get_weights`` and the weight version the parameters belong to."""
        req = service_pb2.GetWeightsRequest(module_id=module_id, dtype=dtype)
        spec = self._spec(module_id) if self.chunking == "auto" else None
        size = 0
        if spec is not None:  # an upper bound of the parameters' bytes
            fc1 = 2 * spec.ffn_features
            size = 4 * (spec.in_features * spec.out_features + spec.out_features +
                        2 * spec.in_features + fc1 * spec.in_features + fc1 +
                        spec.out_features * spec.ffn_features)
        if self._use_chunked(0, size):
            self._check_open("GetWeightsChunked")
            self.chunked_calls += 1
            metadata, traceparent = self._metadata(module_id)
            log.debug("GetWeightsChunked %s (traceparent %s)", module_id, traceparent)
            try:
                stream = self._raw("GetWeightsChunked")(req.SerializeToString(),
                                                        timeout=self.timeout, metadata=metadata)
                resp = _assemble("GetWeightsChunked", stream, service_pb2.GetWeightsResponse)
            except grpc.RpcError as e:
                raise self._error("GetWeightsChunked", e, traceparent) from None
        else:
            resp = self._call("GetWeights", req, module_id, raw=True, route=module_id)
        version = resp.message.weight_version
        self._seen(module_id, version)
        return {p.message.name: _decode(p, "tensor") for p in resp.items("parameters")}, version

    def get_weights_message(self, module_id: str, dtype: int) -> service_pb2.GetWeightsResponse:
        """GetWeights as the server encoded it (unary), for callers that want the wire bytes."""
        return self._call("GetWeights", service_pb2.GetWeightsRequest(module_id=module_id,
                                                                      dtype=dtype), module_id,
                          route=module_id)

    def get_gradients(self, module_id: str, zero: bool = False,
                      dtype: int = wire.F32) -> Dict[str, torch.Tensor]:
        """The gradients the server accumulated for the module since its last optimizer step
        (or zeroing), by parameter name, as float32 CPU tensors; ``zero`` zeroes them after
        reading; ``dtype`` is how they travel."""
        resp = self._call("GetGradients", service_pb2.GetGradientsRequest(
            module_id=module_id, zero=zero, dtype=dtype), module_id, raw=True, route=module_id)
        return {p.message.name: _decode(p, "tensor") for p in resp.items("gradients")}

    def set_weights(self, module_id: str, params: Dict[str, torch.Tensor],
                    dtype: int = wire.F32) -> int:
        """Replaces the named parameters (any subset; all are checked before any changes) with
        ``params`` sent as ``dtype``; returns the new weight version."""
        return self.set_weights_message(self.set_weights_request(module_id, params, dtype))

    @staticmethod
    def set_weights_request(module_id: str, params: Dict[str, torch.Tensor],
                            dtype: int = wire.F32) -> Outgoing:
        """The SetWeightsRequest of ``params`` sent as ``dtype``: an ``Outgoing``, as
        ``forward_request`` makes."""
        req = Outgoing(service_pb2.SetWeightsRequest(module_id=module_id))
        for i, (name, t) in enumerate(params.items()):
            header, data = wire.encode(t, dtype)
            req.message.parameters.add(name=name, tensor=header)
            req.data[_parameter_data(i)] = data
        return req

    def set_weights_message(self, req: Union[Outgoing, service_pb2.SetWeightsRequest]) -> int:
        """SetWeights (or SetWeightsChunked, by size) of a prepared request (a whole message,
        left as it is, or an Outgoing); returns the new weight version."""
        payload = req
        if not isinstance(req, Outgoing):
            # Encoded once; the header and the chunks, if any, read its tensors' bytes there.
            payload = req.SerializeToString()
            received = tensor_messages.parse(type(req), payload)
            req = Outgoing(received.message, received.data)
        module_id = req.message.module_id
        if self._use_chunked(req.nbytes):
            version = self._chunked("SetWeightsChunked", req, service_pb2.SetWeightsRequestPart,
                                    route=module_id).weight_version
        else:
            version = self._call("SetWeights", payload, module_id, raw=True,
                                 route=module_id).weight_version
        self._seen(module_id, version)
        return version


def _path(message_type, *names: str) -> Path:
    """The path (tensor_messages) of a field given by names, from ``message_type`` inwards."""
    path, desc = [], message_type.DESCRIPTOR
    for name in names:
        field = desc.fields_by_name[name]
        path.append(field.number)
        desc = field.message_type
    return tuple(path)


_FORWARD_INPUT = _path(service_pb2.ForwardRequest, "input", "data")
_GRAD_OUTPUT = _path(service_pb2.BackwardRequest, "grad_output", "data")
_GRAD_LAYERNORM_OUTPUT = _path(service_pb2.BackwardRequest, "grad_layernorm_output", "data")
_OUTPUT = _path(service_pb2.ForwardResponse, "output", "data")
_LAYERNORM_OUTPUT = _path(service_pb2.ForwardResponse, "layernorm_output", "data")
_PARAMETERS = _path(service_pb2.SetWeightsRequest, "parameters")
_NAMED_TENSOR = _path(service_pb2.NamedTensor, "tensor")


def _parameter_data(i: int) -> Path:
    """The path of ``parameters[i].tensor.data`` in a SetWeightsRequest."""
    return _PARAMETERS + (i,) + _NAMED_TENSOR + (tensor_messages.DATA,)


def _decode(resp: Received, name: str) -> torch.Tensor:
    """The Tensor field ``name`` of a received message, decoded (wire.decode) from the bytes
    it arrived in."""
    return wire.decode(getattr(resp.message, name), resp.tensor_data(name), resp.owned)


def _slots(msg) -> List[Tuple[Path, object]]:
    """The tensors of a chunked message in chunk order (see service.proto's TensorChunk), each
    with its path in the message."""
    def present(*names: str):
        return [(_path(type(msg), n), getattr(msg, n)) for n in names if msg.HasField(n)]

    if isinstance(msg, service_pb2.ForwardRequest):
        return present("input")
    if isinstance(msg, service_pb2.BackwardRequest):
        return present("grad_output", "grad_layernorm_output")
    if isinstance(msg, service_pb2.ForwardResponse):
        return present("output", "layernorm_output")
    if isinstance(msg, service_pb2.BackwardResponse):
        return present("grad_input")
    number = msg.DESCRIPTOR.fields_by_name["parameters"].number  # Get/SetWeights
    return [((number, i) + _NAMED_TENSOR, p.tensor) for i, p in enumerate(msg.parameters)]


def chunked_parts(request: Outgoing, part_type, chunk_bytes: int) -> Iterator[bytes]:
    """The encoded parts of a chunked request: ``part_type`` (ForwardRequestPart, ...) with
    ``request``'s message as the header (its tensors' data empty), then each tensor's bytes in
    chunks of at most ``chunk_bytes``, each part's encoding written around a slice of the
    tensor's memory (one copy, into the part)."""
    yield part_type(header=request.message).SerializeToString()
    chunk = part_type.DESCRIPTOR.fields_by_name["chunk"].number
    for i, (path, _) in enumerate(_slots(request.message)):
        view = memoryview(request.data.get(path + (tensor_messages.DATA,), b"")).cast("B")
        for off in range(0, view.nbytes, chunk_bytes):
            part = part_type(chunk=service_pb2.TensorChunk(tensor=i, offset=off))
            yield tensor_messages.serialize(part, {
                (chunk, tensor_messages.DATA): view[off:off + chunk_bytes]})


def _assemble(method: str, parts: Iterable[Received], response_type) -> Received:
    """Reassembles a chunked response from its parts (header, then chunks in order), each
    tensor's bytes copied once, from the chunks as they arrived into a buffer of its own."""
    header, buffers, sizes, paths = None, [], [], []
    index, offset, received = 0, 0, 0
    for part in parts:
        msg = part.message
        if msg.HasField("header"):
            if header is not None:
                raise GradwireError(method, "INTERNAL", "the header came twice")
            header = response_type()
            header.CopyFrom(msg.header)
            for path, t in _slots(header):
                # numel elements; for FP8 with a columnwise copy, twice that.
                size = wire.data_bytes(t)
                sizes.append(size)
                paths.append(path + (tensor_messages.DATA,))
                # Not zero-filled: every byte is written by a chunk before it is read.
                buffers.append(np.empty(size, dtype=np.uint8))
            continue
        chunk = part.field("chunk")
        c = chunk.message
        data = chunk.data.get((tensor_messages.DATA,), b"")
        n = len(data)
        while index < len(sizes) and offset >= sizes[index]:
            index, offset = index + 1, 0
        if header is None or c.tensor != index or c.offset != offset or \
                offset + n > sizes[index]:
            raise GradwireError(method, "INTERNAL", "the server sent chunks out of order")
        buffers[index][offset:offset + n] = np.frombuffer(data, dtype=np.uint8)
        offset += n
        received += n
    if header is None:
        raise GradwireError(method, "INTERNAL", "no header")
    if received != sum(sizes):
        raise GradwireError(method, "INTERNAL",
                            f"the response ended early: {received} of {sum(sizes)} bytes")
    return Received(header, dict(zip(paths, buffers)), owned=True)
