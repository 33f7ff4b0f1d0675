"""Frame layout and the send side: fixed prefix + msgpack header + raw payload.

A frame on the wire is::

    prefix   16 bytes, little-endian: magic b"AIOR", version u8, flags u8,
             header length u16, payload length u64
    header   msgpack map (see :class:`Header`)
    payload  raw C-contiguous bytes of one numpy array (may be empty)

The send side never concatenates: :func:`encode_frame` returns the prefix+header bytes and a
memoryview of the array, to be handed to ``transport.writelines`` as they are.
"""

from __future__ import annotations

import enum
import functools
import math
import re
import struct
import threading
from typing import Any, NamedTuple

import msgpack
import numpy as np

from . import tags

MAGIC = b"AIOR"
VERSION = 1
PREFIX = struct.Struct("<4sBBHQ")
PREFIX_SIZE = PREFIX.size  # 16
MAX_HEADER = 0xFFFF  # the prefix stores the header length in a u16
PRE_AUTH_MAX_HEADER = 1024  # handshake headers are small: bound the work an anonymous peer costs
DEFAULT_MAX_PAYLOAD = 1 << 32  # 4 GiB; nodes configure their own bound

# Every dtype our senders write is ``array.dtype.str`` of a non-object array: byte order, kind
# letter, item size, and a datetime unit. Anything else is refused before numpy parses it (some
# strings take numpy a long time, others raise unexpected exception types).
_DTYPE = re.compile(r"[<>|=][biufcmMSUV]\d{1,5}(\[\d*[a-zA-Z]{1,3}\])?")
_PRE_AUTH_KEYS = frozenset({"kind", "step", "tag", "src", "meta"})

Buffer = bytes | bytearray | memoryview
_NO_META: dict[str, Any] = {}  # the default meta, shared: headers never modify theirs


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the connection must be closed."""


class Kind(enum.IntEnum):
    """What a frame is for. Data frames carry arrays; the rest are control traffic."""

    DATA = 0
    HELLO = 1  # connector -> listener: job, rank, nonce
    CHALLENGE = 2  # listener -> connector: nonce, proof of the secret
    AUTH = 3  # connector -> listener: proof of the secret
    WELCOME = 4  # listener -> connector: accepted
    CONTROL = 5  # rendezvous and runtime messages (meta only, no payload)


P2P_TAG = tags.P2P
"""Tags at or above this carry point-to-point messages (torch's ``send``/``recv``): their
``step`` is a per-pair sequence number, not a collective step, so no step floor makes them
stale and no step bound refuses them (the staged-bytes and -frames budgets still hold)."""


def is_p2p(tag: int) -> bool:
    """Is ``tag`` in the point-to-point tag space (:data:`P2P_TAG`)."""
    return tag >= P2P_TAG


class Header(NamedTuple):
    """The decoded msgpack header of one frame: a value, never modified (``meta`` included).

    ``step`` and ``tag`` say which receive a data frame belongs to; ``src`` is the sender's rank.
    ``dtype``/``shape`` describe the payload; ``meta`` carries small control data.

    A named tuple, not a frozen dataclass: one is made for every frame sent and received, and
    a frozen dataclass's ``__init__`` (a guarded ``object.__setattr__`` per field) took 1.9 us
    against 0.5 us.
    """

    kind: Kind = Kind.DATA
    step: int = 0
    tag: int = 0
    src: int = -1
    dtype: str = ""
    shape: tuple[int, ...] = ()
    meta: dict[str, Any] = _NO_META

    def payload_nbytes(self) -> int:
        """Bytes the payload must have for this dtype and shape (0 without a dtype)."""
        if not self.dtype:
            return 0
        return _itemsize(self.dtype) * math.prod(self.shape)

    def to_bytes(self) -> bytes:
        return _pack(self.kind, self.step, self.tag, self.src, self.dtype, self.shape,
                     self.meta)

    @classmethod
    def from_bytes(cls, raw: Buffer, *, restricted: bool = False) -> Header:
        """Decode and validate a header; anything malformed is a :class:`ProtocolError`.

        ``restricted``: the peer has not proved the secret yet. Only the handshake's fields
        are accepted (no dtype, no shape), in small containers, so an anonymous peer cannot
        make us do more than a few microseconds of work per header.
        """
        try:
            # (msgpack's defaults: str keys only, str as str; keyword arguments cost a third
            # of the call, so the authenticated path passes none)
            body = (msgpack.unpackb(raw, **_PRE_AUTH_LIMITS) if restricted
                    else msgpack.unpackb(raw))
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"undecodable header: {exc}") from None
        if not isinstance(body, dict):
            raise ProtocolError("header is not a map")
        if restricted and not _PRE_AUTH_KEYS.issuperset(body):
            raise ProtocolError(f"fields {sorted(set(body) - _PRE_AUTH_KEYS)} before "
                                "authentication")
        try:
            kind = _KINDS[body["kind"]]
            step, tag, src = body["step"], body["tag"], body["src"]
            dtype = body.get("dtype", "")
            shape = tuple(body.get("shape", ()))
            meta = body.get("meta", _NO_META)
        except (KeyError, ValueError, TypeError) as exc:
            raise ProtocolError(f"malformed header: {exc!r}") from None
        # type() is, not isinstance: bools (an int subclass) are refused, and it is cheaper.
        if type(step) is not int or type(tag) is not int or type(src) is not int:
            raise ProtocolError("header step/tag/src must be integers")
        if type(dtype) is not str or type(meta) is not dict:
            raise ProtocolError("header dtype/meta have the wrong type")
        for d in shape:
            if type(d) is not int or d < 0:
                raise ProtocolError("header shape must be non-negative integers")
        if dtype:
            _itemsize(dtype)  # validates it
        return cls(kind, step, tag, src, dtype, shape, meta)


# A frame's kind by number (a dict lookup: Kind(n) costs a microsecond per frame); an unknown
# number is a KeyError, an unhashable one a TypeError: both refused.
_KINDS: dict[int, Kind] = {int(k): k for k in Kind}


@functools.lru_cache(maxsize=64)
def _itemsize(dtype: str) -> int:
    """The item size of a payload dtype string, after checking it; a :class:`ProtocolError`
    if it is not one our senders write. Cached: a job uses one or two dtypes, and parsing them
    for every frame was a tenth of a small frame's receive cost (errors are not cached)."""
    if dtype.lstrip("<>|=")[:1] == "O":
        raise ProtocolError("object dtypes cannot travel as raw bytes")
    if len(dtype) > 16 or not _DTYPE.fullmatch(dtype):
        raise ProtocolError(f"malformed dtype {dtype[:32]!r}")
    try:
        dt = np.dtype(dtype)
    except Exception:  # numpy raises TypeError, ValueError, SyntaxError, ...
        raise ProtocolError(f"unknown dtype {dtype!r}") from None
    if dt.hasobject:
        raise ProtocolError("object dtypes cannot travel as raw bytes")
    return dt.itemsize


def _pack(kind: Kind, step: int, tag: int, src: int, dtype: str, shape: tuple[int, ...],
          meta: dict[str, Any]) -> bytes:
    """A header's msgpack bytes (dtype and shape only with a payload, meta only if any)."""
    body: dict[str, Any] = {"kind": int(kind), "step": step, "tag": tag, "src": src}
    if dtype:
        body["dtype"] = dtype
        body["shape"] = list(shape)
    if meta:
        body["meta"] = meta
    # One packer per thread, kept: msgpack.packb makes a Packer (and its buffer) per call,
    # in a Python function of its own, for every frame sent. (Per thread: lanes' senders
    # encode frames too; a failed pack resets the packer's buffer.)
    try:
        packer = _PACKERS.packer
    except AttributeError:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    out: bytes = packer.pack(body)
    return out


_PACKERS = threading.local()


_PRE_AUTH_LIMITS: dict[str, int] = {"max_str_len": 256, "max_bin_len": 256,
                                     "max_array_len": 16, "max_map_len": 16,
                                     "max_ext_len": 0}


def as_payload(array: np.ndarray) -> np.ndarray:
    """Return ``array`` as a C-contiguous array that can be sent as raw bytes.

    Non-contiguous input is copied (documented, explicit); object arrays are refused.
    """
    if array.dtype.hasobject:
        raise TypeError("object arrays cannot be sent as raw bytes")
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


def byte_view(array: np.ndarray) -> memoryview:
    """A flat, writable-if-possible byte view of a C-contiguous array (works for size 0)."""
    try:
        # A third of numpy's reshape and view: every frame sent or received takes one.
        return array.data.cast("B")
    except (TypeError, ValueError, NotImplementedError):  # zeros in the shape, no buffer
        return array.reshape(-1).view(np.uint8).data


def encode_data(step: int, tag: int, src: int, payload: np.ndarray,
                meta: dict[str, Any] | None = None) -> list[Buffer]:
    """:func:`encode_frame` of a data frame without making its :class:`Header` first (the
    send path of every data frame). ``payload`` must be C-contiguous (:func:`as_payload`)."""
    head = _pack(Kind.DATA, step, tag, src, payload.dtype.str, payload.shape, meta or _NO_META)
    return _buffers(head, payload)


def encode_frame(header: Header, payload: np.ndarray | None = None) -> list[Buffer]:
    """Buffers to write for one frame: ``[prefix+header, payload view]``, no payload copy.

    When ``payload`` is given, its dtype and shape are written into the header. The caller
    must keep ``payload`` unchanged until the transport has sent it.
    """
    if payload is not None:
        payload = as_payload(payload)
        head = _pack(header.kind, header.step, header.tag, header.src, payload.dtype.str,
                     payload.shape, header.meta)
    else:
        head = header.to_bytes()
    return _buffers(head, payload)


def _buffers(head: bytes, payload: np.ndarray | None) -> list[Buffer]:
    """A frame's buffers: prefix and header in one, then the payload's view if it has bytes."""
    if len(head) > MAX_HEADER:
        raise ValueError(f"header of {len(head)} bytes exceeds {MAX_HEADER}")
    nbytes = 0 if payload is None else payload.nbytes
    prefix = PREFIX.pack(MAGIC, VERSION, 0, len(head), nbytes)
    if payload is None or nbytes == 0:
        return [prefix + head]
    return [prefix + head, byte_view(payload)]
