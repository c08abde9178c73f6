"""One ``Train`` stream per client: forwards, backwards and releases as requests on one
bidirectional call, each answered by its ``request_id``, so that several micro-batches are in
flight at once without a round trip each.

The server answers in the order it finishes; a failed request fails only its own future. Contexts
a stream's forwards made are released by the server when the stream ends, so the stream stays
open until ``Client.close()``.
"""

import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Dict, Optional

import grpc
import torch

from gradwire.client import Client, ForwardResult, GradwireError
from gradwire.v1 import service_pb2

_END = object()


class TrainStream:
    """A ``Train`` call of ``client``; use ``Client.train_stream()`` rather than this directly.

    ``forward`` / ``backward`` / ``release`` send one request and return a
    ``concurrent.futures.Future`` of its result (the same values as the client's unary methods).
    """

    def __init__(self, client: Client):
        self.client = client
        self._requests: "queue.Queue" = queue.Queue()
        self._pending: Dict[int, tuple] = {}  # request_id -> (future, decode)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.closed = False
        self._error: Optional[GradwireError] = None

        def requests():
            while True:
                item = self._requests.get()
                if item is _END:
                    return
                yield item

        self._call = client._stub.Train(requests(), metadata=client._metadata)
        self._reader = threading.Thread(target=self._read, name="gradwire-train", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for resp in self._call:
                with self._lock:
                    entry = self._pending.pop(resp.request_id, None)
                if entry is None:
                    continue
                future, method, decode = entry
                if resp.code != 0:
                    name = grpc.StatusCode.UNKNOWN.name
                    for c in grpc.StatusCode:
                        if c.value[0] == resp.code:
                            name = c.name
                    future.set_exception(GradwireError(method, name, resp.message))
                    continue
                try:
                    future.set_result(decode(resp))
                except Exception as e:  # a malformed response fails its own request
                    future.set_exception(e)
                # Hold nothing of a finished request while waiting for the next response: its
                # result (an autograd output among them) must die with its last user.
                entry = future = decode = resp = None
            error = GradwireError("Train", "CANCELLED", "the Train stream ended")
        except grpc.RpcError as e:
            error = GradwireError("Train", e.code().name, e.details())
        self._fail_all(error)

    def _fail_all(self, error: GradwireError) -> None:
        with self._lock:
            self.closed = True
            self._error = error
            pending, self._pending = self._pending, {}
        for future, _, _ in pending.values():
            if not future.done():
                future.set_exception(error)

    def _send(self, method: str, field: str, message, decode) -> Future:
        future: Future = Future()
        with self._lock:
            if self.closed:
                future.set_exception(self._error or GradwireError(
                    "Train", "CANCELLED", "the Train stream is closed"))
                return future
            request_id = next(self._ids)
            self._pending[request_id] = (future, method, decode)
        request = service_pb2.TrainRequest(request_id=request_id)
        getattr(request, field).CopyFrom(message)
        self._requests.put(request)
        return future

    def forward(self, module_id: str, x: torch.Tensor, training: bool = True) -> Future:
        """Future of (output, context_id or "", layernorm_output or None)."""
        req = self.client.forward_request(module_id, x, training)

        def decode(resp) -> ForwardResult:
            result = Client.forward_result(resp.forward)
            self.client._note_instance(result[1])
            return result

        return self._send("Train.Forward", "forward", req, decode)

    def backward(self, context_id: str, grad_output: torch.Tensor,
                 skip_grad_input: bool = False, retain: bool = False) -> Future:
        """Future of grad_input (None with skip_grad_input)."""
        req = self.client.backward_request(context_id, grad_output, skip_grad_input, retain)

        def decode(resp) -> Optional[torch.Tensor]:
            b = resp.backward
            from gradwire import wire
            return wire.from_wire(b.grad_input) if b.HasField("grad_input") else None

        return self._send("Train.Backward", "backward", req, decode)

    def release(self, context_id: str) -> Future:
        return self._send("Train.Release", "release",
                          service_pb2.ReleaseContextRequest(context_id=context_id),
                          lambda resp: None)

    def close(self) -> None:
        """Ends the stream: the server releases the contexts its forwards left."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._requests.put(_END)
        self._reader.join(timeout=self.client.timeout)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join(timeout=5)
