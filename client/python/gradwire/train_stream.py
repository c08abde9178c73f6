"""One ``Train`` stream per client: forwards, backwards and releases as requests on one
bidirectional call, each answered by its ``request_id``, so that several micro-batches are in
flight at once without a round trip each.

The server answers in the order it finishes; a failed request fails only its own future. Contexts
a stream's forwards made are released by the server when the stream ends, so the stream stays
open until ``Client.close()``.

Deadlines: the stream itself lives as long as the client, so its call has no deadline; each
request has one instead, ``Client.timeout`` seconds from when it is sent. A watchdog thread fails
the future of a request that passes it with ``GradwireError(code="DEADLINE_EXCEEDED")`` whose
``method`` names the request ("Train.Forward", "Train.Backward", "Train.Release"), and replaces
the stream: it cancels the call (a stalled server cannot answer the others either), fails the
requests still pending with CANCELLED saying why, and ``Client.train_stream()`` opens a new
stream for the next request. The server releases the contexts of the cancelled stream; a later
backward on one of them gets ``ContextLostError`` (reason "stream_ended"), which
``recompute_on_lost_context`` recovers from.
"""

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Dict, List, NamedTuple, Optional

import grpc
import torch

from gradwire import wire
from gradwire.client import Client, ForwardResult, GradwireError
from gradwire.tensor_messages import Outgoing
from gradwire.v1 import service_pb2

log = logging.getLogger("gradwire")

_END = object()
_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


class _Pending(NamedTuple):
    future: Future
    method: str
    decode: object
    deadline: float  # time.monotonic() past which the request has failed
    sent: float


def train_request_pieces(field: str, request: Outgoing) -> List:
    """The encoding of a TrainRequest whose ``field`` ("forward", "backward", "release") is
    ``request``, without its request_id, as pieces (``tensor_messages.encode``)."""
    return request.within(service_pb2.TrainRequest(), field).pieces()[0]


def train_request(request_id: int, pieces: List) -> bytes:
    """The encoded TrainRequest: ``request_id`` (field 1, so its encoding comes first) joined
    with the rest (``train_request_pieces``); the tensors' bytes are copied here, once."""
    head = service_pb2.TrainRequest(request_id=request_id).SerializeToString()
    return b"".join([head, *pieces])


class TrainStream:
    """A ``Train`` call of ``client``; use ``Client.train_stream()`` rather than this directly.

    ``forward`` / ``backward`` / ``release`` send one request and return a
    ``concurrent.futures.Future`` of its result (the same values as the client's unary methods).
    Every future completes within ``client.timeout`` seconds of its request: with the result,
    with the server's error, or with DEADLINE_EXCEEDED.
    """

    def __init__(self, client: Client, route: Optional[str] = None):
        self.client = client
        self.route = route  # the one module this stream's requests are about, or None
        self.timeout = client.timeout
        self._requests: "queue.Queue" = queue.Queue()
        # request_id -> _Pending, in send order: with one timeout for all, the first entry
        # always has the earliest deadline.
        self._pending: Dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self.closed = False
        self.replaced = False  # a request passed its deadline and the call was cancelled
        self._error: Optional[GradwireError] = None

        def requests():
            while True:
                item = self._requests.get()
                if item is _END:
                    return
                yield item

        # Requests go as the bytes _send encoded; responses come back as Received (their
        # tensors' bytes left in the received message until decoded).
        # One request id for the stream: the server logs each of its requests under it.
        metadata, self.traceparent = client._metadata(route)
        self._call = client._raw("Train")(requests(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="gradwire-train", daemon=True)
        self._reader.start()
        self._watchdog = threading.Thread(target=self._watch, name="gradwire-train-deadlines",
                                          daemon=True)
        self._watchdog.start()
        log.debug("Train stream to %s opened (traceparent %s)", client.server, self.traceparent)

    def _read(self) -> None:
        try:
            for resp in self._call:
                msg = resp.message
                with self._lock:
                    entry = self._pending.pop(msg.request_id, None)
                if entry is None:
                    continue  # failed already (deadline) or unknown
                log.debug("%s request %d: %.1f ms", entry.method, msg.request_id,
                          1e3 * (time.monotonic() - entry.sent))
                if msg.code != 0:
                    # The stream's request id: the server logged this request under it.
                    request_id = self.traceparent.split("-")[1]
                    entry.future.set_exception(GradwireError(
                        entry.method, _CODE_NAMES.get(msg.code, "UNKNOWN"),
                        f"{msg.message} [request {request_id}]", request_id))
                else:
                    try:
                        entry.future.set_result(entry.decode(resp))
                    except Exception as e:  # a malformed response fails its own request
                        entry.future.set_exception(e)
                # Hold nothing of a finished request while waiting for the next response: its
                # result (an autograd output among them) must die with its last user.
                entry = resp = msg = None
            error = GradwireError("Train", "CANCELLED", "the Train stream ended")
        except grpc.RpcError as e:
            error = self.client._error("Train", e, self.traceparent)
        self._fail_all(error)

    def _watch(self) -> None:
        """Fails the first pending request once it passes its deadline, and replaces the
        stream."""
        with self._wake:
            while not self.closed:
                if not self._pending:
                    self._wake.wait()
                    continue
                # Only the deadline is kept while waiting: a reference to the entry would keep
                # its future's result (an autograd output among them) alive.
                request_id = next(iter(self._pending))
                left = self._pending[request_id].deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                first = self._pending.pop(request_id)
                self.closed = self.replaced = True
                pending, self._pending = self._pending, {}
                self._error = GradwireError(
                    "Train", "CANCELLED", f"the Train stream was replaced after {first.method} "
                    f"(request {request_id}) got no answer within {self.timeout:g} s")
                break
            else:
                return
        log.warning("%s request %d: no answer from %s within %g s; replacing the Train stream",
                    first.method, request_id, self.client.server, self.timeout)
        first.future.set_exception(GradwireError(
            first.method, "DEADLINE_EXCEEDED",
            f"no answer within {self.timeout:g} s from {self.client.server} (request "
            f"{request_id} of the Train stream; the stream was replaced, and the server "
            "releases the contexts it made)"))
        for entry in pending.values():
            entry.future.set_exception(GradwireError(entry.method, "CANCELLED",
                                                     self._error.message))
        self._requests.put(_END)
        self._call.cancel()

    def _fail_all(self, error: GradwireError) -> None:
        with self._wake:
            self.closed = True
            if self._error is None:
                self._error = error
            pending, self._pending = self._pending, {}
            self._wake.notify_all()
        for entry in pending.values():
            if not entry.future.done():
                entry.future.set_exception(error)

    def _send(self, method: str, field: str, request: Outgoing, decode) -> Future:
        # Encoded here, on the caller's thread, before the call returns: the request then
        # holds its own copy of the tensors' bytes (one copy, made by the join in
        # train_request), so the caller may change them as soon as this returns, as with any
        # call. The request_id is known only under the lock; the rest is encoded before it.
        pieces = train_request_pieces(field, request)
        future: Future = Future()
        with self._wake:
            if self.closed:
                future.set_exception(self._error or GradwireError(
                    "Train", "CANCELLED", "the Train stream is closed"))
                return future
            request_id = next(self._ids)
            now = time.monotonic()
            if not self._pending:
                self._wake.notify()
            self._pending[request_id] = _Pending(future, method, decode, now + self.timeout, now)
        self._requests.put(train_request(request_id, pieces))
        return future

    def forward(self, module_id: str, x: torch.Tensor, training: bool = True,
                dtype: Optional[int] = None) -> Future:
        """Future of (output, context_id or "", layernorm_output or None). ``dtype``: the wire
        dtype of input and output (default: the client's)."""
        req = self.client.forward_request(module_id, x, training, dtype)

        def decode(resp) -> ForwardResult:
            forward = resp.field("forward")
            self.client._seen(module_id, forward.message.weight_version)
            result = Client.forward_result(forward)
            self.client._note_instance(result[1], module_id)
            self.client._note_context(result[1], module_id)
            return result

        return self._send("Train.Forward", "forward", req, decode)

    def backward(self, context_id: str, grad_output: torch.Tensor,
                 skip_grad_input: bool = False, retain: bool = False,
                 dtype: Optional[int] = None) -> Future:
        """Future of grad_input (None with skip_grad_input). ``retain`` keeps the context for
        another backward."""
        # The context's module: this stream's (a routed one), else the one the client's forward
        # made the context for (its recipe says whether FP8 gradients carry block scales, and
        # whether the exact wire sends grad_output as the module's FP8 cast of it).
        client = self.client
        module_id = self.route or client._context_modules.get(context_id)
        form = client._grad_output_form(
            module_id, grad_output, client.gradient_dtype if dtype is None else dtype)
        req = client.backward_request(context_id, grad_output, skip_grad_input, retain,
                                      dtype=dtype, module_id=module_id, _form=form)
        if form.exact:
            client.exact_fp8_gradients += 1

        def decode(resp) -> Optional[torch.Tensor]:
            b = resp.field("backward")
            if not b.message.HasField("grad_input"):
                return None
            return wire.decode(b.message.grad_input, b.tensor_data("grad_input"))

        return self._send("Train.Backward", "backward", req, decode)

    def release(self, context_id: str) -> Future:
        """Future of None once the context is dropped."""
        return self._send("Train.Release", "release",
                          Outgoing(service_pb2.ReleaseContextRequest(context_id=context_id)),
                          lambda resp: None)

    def close(self, wait: Optional[float] = None) -> None:
        """Ends the stream: the server releases the contexts its forwards left. Waits for the
        server's end of it at most ``wait`` seconds (default: the client's timeout), then cancels
        the call."""
        with self._wake:
            if self.closed:
                return
            self.closed = True
            self._wake.notify_all()
        self._requests.put(_END)
        self._reader.join(timeout=self.timeout if wait is None else wait)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join(timeout=1)
        log.debug("Train stream to %s closed", self.client.server)
