"""Protobuf messages that carry tensors, encoded and parsed with the tensors' bytes kept apart.

A tensor's bytes are the bulk of every Forward, Backward, Train and Get/SetWeights message.
Putting them into a protobuf message copies them (into the message's field, then again when
the message is serialized), and reading them out of a parsed message copies them twice more
(the parser's copy, then, with protobuf's compiled implementations, a new ``bytes`` at every
access of the field). Here a request's tensor bytes are copied once, when its encoding is
joined into the bytes gRPC takes, and a response's not at all until they are decoded:

- a request is kept as an ``Outgoing``: the protobuf message with every field but the tensors'
  ``data``, and those bytes as buffers (memoryviews of the tensors' own memory) under their
  field paths. ``encode`` writes the message's standard encoding around them: protobuf encodes
  the message without them, and each ``data`` field (tag, length, bytes) is spliced in where
  it belongs, in field-number order, with the length prefix of every message that encloses it
  grown to count it. Joining the pieces once gives exactly the bytes ``SerializeToString``
  gives for the whole message, so the server's parser, and any other, reads them unchanged.
- a response is parsed by ``parse``: the ``data`` fields of its tensors are found in the
  received bytes and left there (memoryviews into them), and protobuf parses the rest (a copy
  of the few bytes around them, with the enclosing length prefixes shrunk to match).

A path names a field: the field numbers from the outer message inwards, a repeated field's
number followed by the element's index. ``(2, 0, 2, 3)`` in a SetWeightsRequest is
``parameters[0].tensor.data``.
"""

import threading
from typing import Dict, List, Mapping, Optional, Tuple

from gradwire.v1 import service_pb2, tensor_pb2

Path = Tuple[int, ...]

# The messages whose `data` field holds a tensor's bytes; both number it alike.
_CARRIERS = (tensor_pb2.Tensor.DESCRIPTOR.full_name, service_pb2.TensorChunk.DESCRIPTOR.full_name)
DATA = tensor_pb2.Tensor.DESCRIPTOR.fields_by_name["data"].number
assert service_pb2.TensorChunk.DESCRIPTOR.fields_by_name["data"].number == DATA

_LEN = 2  # protobuf wire type of length-delimited fields
_SMALL = [bytes((i,)) for i in range(0x80)]


def _varint(buf, pos: int) -> Tuple[int, int]:
    """The varint at ``buf[pos]`` and the position after it."""
    result, shift = 0, 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed protobuf: a varint longer than 10 bytes")


def varint(n: int) -> bytes:
    """The protobuf varint encoding of ``n`` >= 0."""
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_routes_cache: Dict[str, Dict[int, Tuple[object, bool]]] = {}
_routes_lock = threading.Lock()  # a response reader thread and the caller may ask at once


def _routes(desc) -> Dict[int, Tuple[object, bool]]:
    """The fields of message type ``desc`` through which a tensor's bytes can be reached:
    field number -> (its message type, whether it is repeated)."""
    routes = _routes_cache.get(desc.full_name)
    if routes is None:
        with _routes_lock:
            routes = _find_routes(desc, set())
    return routes


def _find_routes(desc, visiting: set) -> Dict[int, Tuple[object, bool]]:
    """``_routes``, computed (under the lock) and published only once complete. A type that
    contains itself is not followed into again (no message here does)."""
    routes = _routes_cache.get(desc.full_name)
    if routes is not None:
        return routes
    visiting.add(desc.full_name)
    routes = {}
    for f in desc.fields:
        sub = f.message_type
        if sub is None or sub.full_name in visiting:
            continue
        if sub.full_name in _CARRIERS or _find_routes(sub, visiting):
            routes[f.number] = (sub, f.label == f.LABEL_REPEATED)
    visiting.discard(desc.full_name)
    _routes_cache[desc.full_name] = routes
    return routes


def _carries(desc) -> bool:
    """Whether messages of type ``desc`` can hold a tensor's bytes."""
    return desc.full_name in _CARRIERS or bool(_routes(desc))


def _skip(buf, pos: int, kind: int) -> int:
    """The position after the value, of wire type ``kind``, at ``pos`` (not for LEN)."""
    if kind == 0:
        return _varint(buf, pos)[1]
    if kind == 1:
        return pos + 8
    if kind == 5:
        return pos + 4
    raise ValueError(f"malformed protobuf: wire type {kind}")


# --- requests


def _as_bytes_view(buf) -> memoryview:
    view = memoryview(buf)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def _tree(data: Mapping[Path, object]) -> dict:
    """``data`` as nested dicts by path element; the leaves are byte memoryviews."""
    root: dict = {}
    for path, buf in data.items():
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = _as_bytes_view(buf)
    return root


def _splice(meta: bytes, view: memoryview, start: int, end: int, desc, node: dict,
            pieces: list) -> Tuple[int, int]:
    """Appends to ``pieces`` the encoding of the message ``meta[start:end]`` (of type
    ``desc``) with the buffers of ``node`` spliced in; returns (its length, the buffer bytes
    placed)."""
    routes = _routes(desc)
    leaves = sorted((n, v) for n, v in node.items() if not isinstance(v, dict) and v.nbytes)
    size = placed = 0
    run = pos = start  # meta[run:pos] is still to be appended as it is
    counts: Dict[int, int] = {}
    li = 0

    def leaf(number: int, buf: memoryview) -> int:
        head = varint(number << 3 | _LEN) + varint(buf.nbytes)
        pieces.append(head)
        pieces.append(buf)
        return len(head) + buf.nbytes

    while pos < end:
        field_start = pos
        key, pos = _varint(meta, pos)
        number, kind = key >> 3, key & 7
        while li < len(leaves) and leaves[li][0] < number:
            pieces.append(view[run:field_start])
            size += field_start - run + leaf(*leaves[li])
            placed += leaves[li][1].nbytes
            run = field_start
            li += 1
        if li < len(leaves) and leaves[li][0] == number:
            raise ValueError(f"field {number} of {desc.full_name} holds bytes in the message "
                             "and apart from it")
        if kind != _LEN:
            pos = _skip(meta, pos, kind)
            continue
        key_end = pos
        length, body = _varint(meta, pos)
        pos = body + length
        child = node.get(number)
        if number not in routes or not isinstance(child, dict):
            continue
        sub_desc, repeated = routes[number]
        if repeated:
            index = counts.get(number, 0)
            counts[number] = index + 1
            child = child.get(index)
            if not child:
                continue
        sub: list = []
        sub_size, sub_placed = _splice(meta, view, body, pos, sub_desc, child, sub)
        if sub_placed:
            head = varint(sub_size)
            pieces.append(view[run:key_end])
            pieces.append(head)
            pieces.extend(sub)
            size += key_end - run + len(head) + sub_size
            placed += sub_placed
            run = pos
    if pos != end:
        raise ValueError("malformed protobuf: a field runs past its message")
    pieces.append(view[run:end])
    size += end - run
    for number, buf in leaves[li:]:
        size += leaf(number, buf)
        placed += buf.nbytes
    return size, placed


def encode(message, data: Mapping[Path, object]) -> Tuple[List, int]:
    """The standard protobuf encoding of ``message`` with each buffer of ``data`` as the bytes
    field at its path (fields that ``message`` leaves empty), as pieces to join and their total
    length. The pieces are slices of the message's own small encoding and the buffers
    themselves: nothing of a buffer is copied until the pieces are joined."""
    meta = message.SerializeToString()
    tree = _tree(data)
    pieces: list = []
    size, placed = _splice(meta, memoryview(meta), 0, len(meta), message.DESCRIPTOR, tree,
                           pieces)
    want = sum(_as_bytes_view(b).nbytes for b in data.values())
    if placed != want:
        raise ValueError(f"{want - placed} bytes of tensor data have no place in the "
                         f"{message.DESCRIPTOR.full_name}: their message is not set in it")
    return pieces, size


def serialize(message, data: Mapping[Path, object]) -> bytes:
    """``encode`` joined: byte for byte ``SerializeToString()`` of the whole message, with
    each buffer copied once."""
    if not data:
        return message.SerializeToString()
    return b"".join(encode(message, data)[0])


class Outgoing:
    """A request: ``message``, every field but its tensors' bytes, and ``data``, those bytes by
    path (memoryviews of the tensors' memory, not copies). Reading an attribute reads the
    message's field (its tensors' ``data`` fields are empty); ``SerializeToString()`` gives the
    encoding of the whole message, as protobuf would."""

    __slots__ = ("message", "data")

    def __init__(self, message, data: Optional[Dict[Path, object]] = None):
        self.message = message
        self.data: Dict[Path, object] = dict(data or {})

    def __getattr__(self, name: str):
        if name in Outgoing.__slots__:
            raise AttributeError(name)
        return getattr(self.message, name)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the request carries."""
        return sum(_as_bytes_view(b).nbytes for b in self.data.values())

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's name
        return serialize(self.message, self.data)

    def pieces(self) -> Tuple[List, int]:
        """``encode`` of this request: pieces to join, and their length."""
        return encode(self.message, self.data)

    def within(self, outer, field: str) -> "Outgoing":
        """This request as field ``field`` of ``outer`` (a message, changed: the field is set to
        a copy of this message, without the tensors' bytes)."""
        getattr(outer, field).CopyFrom(self.message)
        number = outer.DESCRIPTOR.fields_by_name[field].number
        return Outgoing(outer, {(number,) + p: b for p, b in self.data.items()})

    def to_message(self):
        """The whole protobuf message, the tensors' bytes copied into it."""
        return type(self.message).FromString(self.SerializeToString())


# --- responses


def _strip(buf: bytes, view: memoryview, start: int, end: int, desc, path: Path,
           data: Dict[Path, memoryview], pieces: list) -> Tuple[int, bool]:
    """Appends to ``pieces`` the message ``buf[start:end]`` (of type ``desc``) without its
    tensors' ``data`` fields, which go into ``data`` by path as views of ``buf``; returns (the
    length appended, whether anything was taken out). Nothing is appended when nothing was."""
    routes = _routes(desc)
    carrier = desc.full_name in _CARRIERS
    size = 0
    changed = False
    run = pos = start
    counts: Dict[int, int] = {}
    while pos < end:
        field_start = pos
        key, pos = _varint(buf, pos)
        number, kind = key >> 3, key & 7
        if kind != _LEN:
            pos = _skip(buf, pos, kind)
            continue
        key_end = pos
        length, body = _varint(buf, pos)
        pos = body + length
        if pos > end:
            break
        if carrier and number == DATA:
            data[path + (number,)] = view[body:pos]  # the last one wins, as in protobuf
            pieces.append(view[run:field_start])
            size += field_start - run
            run = pos
            changed = True
            continue
        route = routes.get(number)
        if route is None:
            continue
        sub_desc, repeated = route
        sub_path = path + (number,)
        if repeated:
            index = counts.get(number, 0)
            counts[number] = index + 1
            sub_path += (index,)
        sub: list = []
        sub_size, sub_changed = _strip(buf, view, body, pos, sub_desc, sub_path, data, sub)
        if sub_changed:
            head = varint(sub_size)
            pieces.append(view[run:key_end])
            pieces.append(head)
            pieces.extend(sub)
            size += key_end - run + len(head) + sub_size
            run = pos
            changed = True
    if pos != end:
        raise ValueError("malformed protobuf: a field runs past its message")
    if changed:
        pieces.append(view[run:end])
        size += end - run
    return size, changed


class Received:
    """A parsed response: ``message``, every field but its tensors' bytes, and ``data``, those
    bytes by path: views of the received bytes (read-only, not copied), or buffers of their own
    when ``owned`` (writable, and nothing else refers to them: a decoded tensor may keep them as
    its memory). Reading an attribute reads the message's field."""

    __slots__ = ("message", "data", "owned")

    def __init__(self, message, data: Optional[Dict[Path, object]] = None, owned: bool = False):
        self.message = message
        self.data: Dict[Path, object] = data if data is not None else {}
        self.owned = owned

    def __getattr__(self, name: str):
        if name in Received.__slots__:
            raise AttributeError(name)
        return getattr(self.message, name)

    def _number(self, name: str) -> int:
        return self.message.DESCRIPTOR.fields_by_name[name].number

    def field(self, name: str) -> "Received":
        """The message field ``name``, with the bytes under it."""
        number = self._number(name)
        data = {p[1:]: b for p, b in self.data.items() if p[0] == number}
        return Received(getattr(self.message, name), data, self.owned)

    def items(self, name: str) -> List["Received"]:
        """The elements of the repeated message field ``name``, each with the bytes under
        it."""
        number = self._number(name)
        out = []
        for i, m in enumerate(getattr(self.message, name)):
            data = {p[2:]: b for p, b in self.data.items() if p[:2] == (number, i)}
            out.append(Received(m, data, self.owned))
        return out

    def tensor_data(self, name: str):
        """The bytes of the Tensor field ``name`` (empty when it carries none)."""
        return self.data.get((self._number(name), DATA), b"")


def parse(message_type, buf: bytes) -> Received:
    """A response of ``message_type`` from its encoding ``buf``, its tensors' bytes left in
    ``buf``."""
    data: Dict[Path, memoryview] = {}
    pieces: list = []
    view = memoryview(buf)
    _, changed = _strip(buf, view, 0, len(buf), message_type.DESCRIPTOR, (), data, pieces)
    message = message_type.FromString(b"".join(pieces) if changed else buf)
    return Received(message, data)


def reader(message_type):
    """A gRPC response deserializer for ``message_type``: ``parse`` for messages that can carry
    tensors, protobuf's own parser for the others."""
    if not _carries(message_type.DESCRIPTOR):
        return message_type.FromString
    return lambda buf: parse(message_type, buf)
