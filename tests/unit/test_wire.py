"""Framing: round trips, any byte split, bounds and malformed input (no sockets)."""

from __future__ import annotations

import itertools
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioreduce.wire import (
    DEFER,
    PREFIX_SIZE,
    FrameDecoder,
    Header,
    Kind,
    ProtocolError,
    byte_view,
    encode_frame,
)
from aioreduce.wire.frame import MAGIC, PREFIX, VERSION
from aioreduce.wire.handshake import (
    Accepted,
    ConnectorHandshake,
    ListenerHandshake,
    Proved,
    Refused,
    WrongJob,
    check,
    new_nonce,
    proof,
    refusal,
)

DTYPES = ["<f4", "<f8", "<i8", "|u1", "<c16", "<f2", "|b1"]


def wire_bytes(header: Header, payload: np.ndarray | None = None) -> bytes:
    return b"".join(bytes(b) for b in encode_frame(header, payload))


def collecting_decoder(max_payload: int = 1 << 30) -> tuple[FrameDecoder, list[np.ndarray]]:
    """A decoder that allocates a fresh destination per frame and records them."""
    dests: list[np.ndarray] = []

    def choose(h: Header) -> memoryview:
        buf = np.empty(h.payload_nbytes(), np.uint8)
        dests.append(buf)
        return byte_view(buf)

    return FrameDecoder(choose, max_payload), dests


def test_round_trip_dtypes_and_shapes() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 4)).astype(dt) for dt in DTYPES]
    arrays += [np.zeros((0,), "<f4"), np.zeros((2, 0, 3), "<f8"), np.arange(7, dtype="<i4")[::2]]
    stream = b"".join(wire_bytes(Header(step=i, tag=i % 3, src=5), a) for i, a in enumerate(arrays))
    dec, _ = collecting_decoder()
    frames = dec.receive_data(stream)
    assert len(frames) == len(arrays)
    for i, (frame, sent) in enumerate(zip(frames, arrays, strict=True)):
        h = frame.header
        assert (h.step, h.tag, h.src, h.kind) == (i, i % 3, 5, Kind.DATA)
        assert frame.payload is not None
        got = np.frombuffer(frame.payload, dtype=h.dtype).reshape(h.shape)
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert got.tobytes() == np.ascontiguousarray(sent).tobytes()


def test_send_side_does_not_copy_the_payload() -> None:
    a = np.arange(1 << 16, dtype=np.float32)
    bufs = encode_frame(Header(), a)
    assert len(bufs) == 2
    view = bufs[1]
    assert isinstance(view, memoryview)
    a[0] = 42.0  # the view aliases the array
    assert np.frombuffer(view, np.float32)[0] == 42.0


def test_control_frame_without_payload() -> None:
    dec, dests = collecting_decoder()
    meta = {"op": "register", "host": "10.0.0.1", "port": 4000, "blob": b"\x00\x01"}
    (frame,) = dec.receive_data(wire_bytes(Header(Kind.CONTROL, meta=meta)))
    assert frame.header.meta == meta and not dests


frames_strategy = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3),
              st.integers(0, 2**40), st.integers(-3, 3)),
    min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(frames_strategy, st.lists(st.integers(1, 400), min_size=1, max_size=50))
def test_any_split_yields_the_same_frames(spec: list, cuts: list[int]) -> None:
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 255, size=tuple(shape), dtype=np.uint8).view(np.uint8)
              .astype(dt) for dt, shape, _s, _t in spec]
    headers = [Header(step=s, tag=t, src=1) for _dt, _sh, s, t in spec]
    stream = b"".join(wire_bytes(h, a) for h, a in zip(headers, arrays, strict=True))

    whole, _ = collecting_decoder()
    expected = [(f.header, bytes(f.payload or b"")) for f in whole.receive_data(stream)]

    pieces, pos, i = [], 0, 0
    while pos < len(stream):
        n = cuts[i % len(cuts)]
        pieces.append(stream[pos:pos + n])
        pos += n
        i += 1
    split, _ = collecting_decoder()
    got = []
    for piece in pieces:
        got += [(f.header, bytes(f.payload or b"")) for f in split.receive_data(piece)]
    assert got == expected
    assert len(got) == len(arrays)
    assert not split.mid_frame


def test_after_a_large_payload_the_next_header_is_read_exactly() -> None:
    # A kernel that fills whatever buffer it is given. After a payload larger than the staging
    # buffer, the next prefix is read with as many header bytes as the last header had, so
    # the following payload goes straight to its destination instead of partly through the
    # staging buffer: a header as long takes one read, a shorter one stages the difference
    # of the payload, a longer one takes a second read for its rest.
    big, small = np.arange(80_000, dtype="<f4"), np.arange(10, dtype="<f4")  # 320 KB, 40 B
    arrays = [big, big, small, big, big * 2]
    headers = [Header(step=i, tag=0, src=1) for i in range(len(arrays))]
    stream = memoryview(b"".join(wire_bytes(h, a) for h, a in zip(headers, arrays, strict=True)))
    dec, _ = collecting_decoder()
    staged: list[int] = [0]  # bytes that landed outside a destination, per frame
    reads: list[int] = [0]  # reads that landed in the staging buffer, per frame
    frames = []
    pos = 0
    while pos < len(stream):
        buf = dec.get_buffer()
        n = min(len(buf), len(stream) - pos)
        buf[:n] = stream[pos:pos + n]
        pos += n
        if isinstance(buf.obj, bytearray):
            staged[-1] += n
            reads[-1] += 1
        for frame in dec.buffer_updated(n):
            frames.append(frame)
            staged.append(0)
            reads.append(0)
    assert [bytes(f.payload or b"") for f in frames] == [a.tobytes() for a in arrays]
    head = [len(wire_bytes(h, a)) - a.nbytes - PREFIX_SIZE
            for h, a in zip(headers, arrays, strict=True)]
    assert head[2] < head[1]  # the small frame's shape is shorter in msgpack
    exact = [PREFIX_SIZE + n for n in head]
    assert staged[0] > exact[0]  # the first read asks for all there is (nothing known yet)
    assert staged[1] == exact[1] and reads[1] == 1  # as long as the last: one read
    assert staged[2] == PREFIX_SIZE + head[1]  # shorter: the difference is payload, staged
    # After the small frame the read is large again (small frames come in runs too): the
    # big payload behind it is partly staged, and the one after that is exact once more.
    assert staged[3] > exact[3] and staged[4] == exact[4] and reads[4] == 1


@pytest.mark.parametrize("cut", [1, 7, 4096, 200_000])
def test_large_frames_survive_any_split(cut: int) -> None:
    arrays = [np.arange(60_000, dtype="<f8"), np.arange(3, dtype="<i8"),
              np.arange(70_000, dtype="<f4"), np.arange(50_000, dtype="<f4")]
    headers = [Header(step=i, tag=i, src=2) for i in range(len(arrays))]
    stream = b"".join(wire_bytes(h, a) for h, a in zip(headers, arrays, strict=True))
    dec, _ = collecting_decoder()
    got = []
    for start in range(0, len(stream), cut):
        got += [(f.header.step, f.header.tag, bytes(f.payload or b""))
                for f in dec.receive_data(stream[start:start + cut])]
    assert got == [(h.step, h.tag, a.tobytes()) for h, a in zip(headers, arrays, strict=True)]
    assert not dec.mid_frame


def _raw(magic: bytes = MAGIC, version: int = VERSION, hlen: int | None = None,
         plen: int = 0, header: bytes | None = None) -> bytes:
    head = header if header is not None else Header().to_bytes()
    return PREFIX.pack(magic, version, 0, len(head) if hlen is None else hlen, plen) + head


@pytest.mark.parametrize("data, message", [
    (_raw(magic=b"HTTP"), "bad magic"),
    (_raw(version=9), "version"),
    (_raw(hlen=0), "header length"),
    (_raw(plen=1 << 31), "exceeds the limit"),
    (_raw(header=b"\xc1\xc1\xc1"), "undecodable"),
    (_raw(header=msgpack.packb([1, 2, 3])), "not a map"),
    (_raw(header=msgpack.packb({"kind": 77, "step": 0, "tag": 0, "src": 0})), "malformed"),
    (_raw(header=msgpack.packb({"kind": 0, "step": "x", "tag": 0, "src": 0})), "integers"),
    (_raw(header=msgpack.packb({"kind": 0, "step": 0, "tag": 0, "src": 0, "dtype": "O",
                                "shape": [1]}), plen=8), "object"),
    (_raw(header=msgpack.packb({"kind": 0, "step": 0, "tag": 0, "src": 0, "dtype": "<f4",
                                "shape": [3]}), plen=8), "does not match"),
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"),
])
def test_malformed_input_is_a_protocol_error(data: bytes, message: str) -> None:
    dec, dests = collecting_decoder(max_payload=1 << 20)
    with pytest.raises(ProtocolError, match=message):
        dec.receive_data(data)
    assert not dests  # nothing was allocated for a bad frame


def test_payload_limit_applies_before_anything_is_allocated() -> None:
    dec, dests = collecting_decoder(max_payload=0)  # as before authentication
    with pytest.raises(ProtocolError, match="exceeds"):
        dec.receive_data(wire_bytes(Header(), np.zeros(4, np.float32)))
    assert not dests


def test_defer_holds_the_frame_until_resume() -> None:
    out = np.zeros(1000, np.float64)
    dec = FrameDecoder(lambda h: DEFER, 1 << 20)
    stream = wire_bytes(Header(step=2), np.arange(1000.0)) + wire_bytes(Header(step=3))
    buf = dec.get_buffer()
    n = min(len(buf), len(stream))
    buf[:n] = stream[:n]
    assert list(dec.buffer_updated(n)) == []
    assert dec.waiting and dec.pending_header is not None and dec.pending_header.step == 2
    assert len(dec.get_buffer()) == 0  # nothing more is read while waiting
    frames = list(dec.resume(byte_view(out)))
    rest = dec.receive_data(stream[n:])
    assert [f.header.step for f in frames + rest] == [2, 3]
    assert np.array_equal(out, np.arange(1000.0))


def test_discarded_payload_goes_to_scratch_and_later_frames_survive() -> None:
    dec = FrameDecoder(lambda h: None, 1 << 30)
    big = np.ones(3 << 20, np.uint8)  # larger than the scratch buffer
    frames = dec.receive_data(wire_bytes(Header(step=1), big) + wire_bytes(Header(step=2)))
    assert [(f.header.step, f.payload is None) for f in frames] == [(1, True), (2, False)]


def test_redirect_to_scratch_stops_writing_the_callers_buffer() -> None:
    out = np.zeros(1 << 20, np.uint8)
    dec = FrameDecoder(lambda h: byte_view(out), 1 << 30)
    stream = wire_bytes(Header(), np.full(1 << 20, 7, np.uint8))
    half = PREFIX_SIZE + 200_000
    dec.receive_data(stream[:half])
    written = int((out == 7).sum())
    dec.redirect_to_scratch()
    (frame,) = dec.receive_data(stream[half:])
    assert frame.payload is None
    assert int((out == 7).sum()) == written  # not one byte more


def test_handshake_proofs_bind_role_rank_and_nonces() -> None:
    s, nc, ns = b"secret", new_nonce(), new_nonce()
    base = proof(s, "connector", "job", 3, nc, ns)
    assert check(base, proof(s, "connector", "job", 3, nc, ns))
    for other in (proof(b"other", "connector", "job", 3, nc, ns),
                  proof(s, "listener", "job", 3, nc, ns),
                  proof(s, "connector", "job2", 3, nc, ns),
                  proof(s, "connector", "job", 4, nc, ns),
                  proof(s, "connector", "job", 3, ns, nc)):
        assert not check(base, other)
    assert not check(base, "not bytes")
    assert len(nc) == 32 and nc != ns


def test_prefix_layout_is_stable() -> None:
    raw = wire_bytes(Header(step=1), np.zeros(2, np.float32))
    magic, version, flags, hlen, plen = struct.unpack_from("<4sBBHQ", raw)
    assert (magic, version, flags, plen) == (b"AIOR", 1, 0, 8)
    assert len(raw) == PREFIX_SIZE + hlen + 8


# --- the handshake state machines, without sockets ------------------------------------------

def _pair(secret_c: bytes = b"s", secret_l: bytes = b"s", job: str = "j"
          ) -> tuple[ConnectorHandshake, ListenerHandshake]:
    return ConnectorHandshake(secret_c, job, 2, 0), ListenerHandshake(secret_l, "j", 0, 4)


def test_handshake_state_machines_complete_with_the_same_secret() -> None:
    conn, lis = _pair()
    challenge, ev = lis.receive(conn.start())
    assert ev is None and [h.kind for h in challenge] == [Kind.CHALLENGE]
    auth, ev = conn.receive(challenge[0])
    assert ev == Proved(0) and [h.kind for h in auth] == [Kind.AUTH]
    welcome, ev = lis.receive(auth[0])
    assert ev == Accepted(2) and [h.kind for h in welcome] == [Kind.WELCOME]
    assert conn.receive(welcome[0]) == ([], Accepted(0))


@pytest.mark.parametrize("case, reason", [
    ("listener-secret", "could not prove the job secret"),
    ("connector-secret", "could not prove the job secret"),  # mismatch: seen here first
])
def test_handshake_refuses_with_the_reason(case: str, reason: str) -> None:
    conn, lis = _pair(secret_l=b"x" if case == "listener-secret" else b"s",
                      secret_c=b"x" if case == "connector-secret" else b"s",
                      job="other" if case == "job" else "j")
    out, ev = lis.receive(conn.start())
    if isinstance(ev, Refused):
        assert reason in ev.reason and _told(out) == ev.reason
        return
    auth, ev = conn.receive(out[0])
    if isinstance(ev, Refused):
        assert reason in ev.reason and auth == []
        return
    out, ev = lis.receive(auth[0])
    assert isinstance(ev, Refused) and reason in ev.reason and _told(out) == ev.reason


def test_a_wrong_job_id_with_the_secret_is_told_which_job_this_is() -> None:
    conn, lis = _pair(job="other")
    challenge, ev = lis.receive(conn.start())  # proofs computed under the job id it names
    auth, ev = conn.receive(challenge[0])
    assert ev == Proved(0)
    told, ev = lis.receive(auth[0])
    assert ev == WrongJob(2, "other")
    assert [h.kind for h in told] == [Kind.CONTROL] and told[0].meta["job"] == "j"
    out, ev = conn.receive(told[0])
    assert isinstance(ev, Refused) and out == []
    assert "serves job 'j', this rank was started for job 'other'" in ev.reason


def test_a_wrong_job_id_without_the_secret_learns_nothing() -> None:
    conn, lis = _pair(secret_c=b"x", job="other")
    challenge, _ = lis.receive(conn.start())
    out, ev = conn.receive(challenge[0])  # the listener's proof fails for it
    assert isinstance(ev, Refused) and out == []
    forged = Header(Kind.AUTH, meta={"proof": b"\0" * 32})
    out, ev = lis.receive(forged)
    assert isinstance(ev, Refused) and "wrong proof" in ev.reason
    assert _told(out) == ev.reason  # what it did wrong, nothing of the job
    conn2, lis2 = _pair(job="x" * 200)  # an oversized job id: refused before any HMAC
    out, ev = lis2.receive(conn2.start())
    assert isinstance(ev, Refused) and _told(out) == "no valid job id"


def test_handshake_listener_refuses_a_forged_auth() -> None:
    conn, lis = _pair()
    lis.receive(conn.start())
    out, ev = lis.receive(Header(Kind.AUTH, meta={"proof": b"\0" * 32}))
    assert isinstance(ev, Refused) and "wrong proof of the job secret" in ev.reason
    assert _told(out) == ev.reason


def test_handshake_refuses_frames_out_of_order_and_bad_fields() -> None:
    _conn, lis = _pair()
    assert isinstance(lis.receive(Header(Kind.AUTH, meta={"proof": b"x"}))[1], Refused)
    for meta in ({"job": "j", "rank": 0, "nonce": b"n"},  # its own rank
                 {"job": "j", "rank": 9, "nonce": b"n"},  # outside the world
                 {"job": "j", "rank": True, "nonce": b"n"},
                 {"job": "j", "rank": 1, "nonce": "text"}):
        _c, lis = _pair()
        assert isinstance(lis.receive(Header(Kind.HELLO, meta=meta))[1], Refused), meta
    conn, _l = _pair()
    conn.start()
    assert isinstance(conn.receive(Header(Kind.WELCOME))[1], Refused)  # WELCOME before proof


def _told(out: list[Header]) -> str:
    """The reason in the one refusal frame a refusing side sends before it closes."""
    assert len(out) == 1 and out[0].kind is Kind.CONTROL and out[0].meta["op"] == "refused"
    return str(out[0].meta["reason"])


def test_a_connector_believes_a_refusal_only_from_a_listener_that_proved_the_secret() -> None:
    # Refused after the proof: a rank of this job means it (e.g. this rank started twice).
    conn, lis = _pair()
    _auth, ev = conn.receive(lis.receive(conn.start())[0][0])
    assert ev == Proved(0)
    out, ev = conn.receive(refusal(0, "rank 2 is already connected from 10.0.0.9:4000"))
    assert out == [] and ev == Refused("rank 2 is already connected from 10.0.0.9:4000")
    # Refused before it: anyone could say so, and the reason says that it was not proved.
    conn, _l = _pair()
    conn.start()
    out, ev = conn.receive(refusal(0, "x" * 10_000))
    assert out == [] and isinstance(ev, Refused)
    assert ev.reason.startswith("refused before proving the secret: xxx")
    assert len(ev.reason) < 400  # a stranger's reason is bounded


# --- bounded work before authentication (issue 11) -----------------------------------------

def pre_auth_decoder() -> FrameDecoder:
    return FrameDecoder(lambda h: None, 0, authenticated=False)


def test_pre_auth_decoder_is_small_and_refuses_long_headers() -> None:
    dec = pre_auth_decoder()
    assert dec.staging_bytes <= 4096
    long = Header(Kind.HELLO, meta={"job": "j" * 2000})
    with pytest.raises(ProtocolError, match="header length"):
        dec.receive_data(wire_bytes(long))
    dec = pre_auth_decoder()
    dec.authenticate(1 << 20)
    assert dec.staging_bytes >= 1 << 17
    assert dec.receive_data(wire_bytes(long))[0].header.meta["job"] == "j" * 2000


@pytest.mark.parametrize("body", [
    {"kind": 1, "step": 0, "tag": 0, "src": 0, "dtype": "<f8", "shape": [0]},  # no dtype
    {"kind": 1, "step": 0, "tag": 0, "src": 0, "meta": {str(i): i for i in range(40)}},
    {"kind": 1, "step": 0, "tag": 0, "src": 0, "meta": {"a": list(range(40))}},
    {"kind": 1, "step": 0, "tag": 0, "src": 0, "meta": {"a": "x" * 600}},
], ids=["dtype", "big-map", "big-array", "long-string"])
def test_pre_auth_headers_are_restricted_to_the_handshake_schema(body: dict) -> None:
    head = msgpack.packb(body, use_bin_type=True)
    assert len(head) <= 1024
    data = PREFIX.pack(MAGIC, VERSION, 0, len(head), 0) + head
    with pytest.raises(ProtocolError):
        pre_auth_decoder().receive_data(data)
    assert collecting_decoder()[0].receive_data(data)  # the same header is fine after auth


@pytest.mark.parametrize("dtype", ["(-1,)i4", "b,,,", "i4" * 40, "<f8,<f8", "O", "|O8",
                                   "<U99999999", "[('a', '<f8')]", "<M8[ns"])
def test_odd_dtype_strings_are_protocol_errors(dtype: str) -> None:
    head = msgpack.packb({"kind": 0, "step": 0, "tag": 0, "src": 0, "dtype": dtype,
                          "shape": [1]}, use_bin_type=True)
    with pytest.raises(ProtocolError):
        Header.from_bytes(head)


def test_every_dtype_we_send_is_accepted() -> None:
    for dt in ["f2", "f4", "f8", "c16", "i1", "u8", "?", "M8[ns]", "m8[us]", "S5", "U3",
               "V12", np.dtype([("a", "<f8"), ("b", "<i4")])]:
        arr = np.zeros(3, dt)
        frames = collecting_decoder()[0].receive_data(wire_bytes(Header(Kind.DATA), arr))
        assert frames[0].header.dtype == arr.dtype.str


def test_payload_left_counts_down_a_payload_landing_in_its_destination_only() -> None:
    """What the protocol sets SO_RCVLOWAT from: never more than the frame still owes."""
    out = np.zeros(1000, np.uint8)
    dec = FrameDecoder(lambda h: byte_view(out) if h.step == 1 else None, 1 << 20)
    stream = (wire_bytes(Header(step=1), np.full(1000, 3, np.uint8))
              + wire_bytes(Header(step=2), np.ones(500, np.uint8)) + wire_bytes(Header(step=3)))
    assert dec.payload_left == 0  # waiting for a prefix
    seen = []
    for byte in stream:  # one byte per read: every state the decoder passes through
        dec.receive_data(bytes([byte]))
        seen.append(dec.payload_left)
    start = seen.index(1000)
    assert seen[start:start + 1000] == list(range(1000, 0, -1))  # step 1, byte by byte
    assert set(seen[:start]) == {0} and set(seen[start + 1000:]) == {0}  # step 2: discarded
    assert (out == 3).all()


def test_every_tag_has_a_range_of_its_own_and_control_sits_above_data() -> None:
    from aioreduce.schemes.exchange import EXCHANGE_TAG
    from aioreduce.schemes.reduce.family import DOWN, REQUEST_TAG, VERDICT_TAG
    from aioreduce.schemes.ring import ABORT_TAG
    from aioreduce.schemes.transpose.layout import NOTICE_TAG, PHASE2_TAG
    from aioreduce.transport.mesh import LANE_TAG
    from aioreduce.wire import P2P_TAG, tags

    spans = sorted(tags.RANGES.values())
    assert all(lo < hi for lo, hi in spans)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    # What the modules use is the registry's (no tag defined anywhere else).
    assert (PHASE2_TAG, NOTICE_TAG, DOWN) == (tags.SECOND, tags.NOTICE, tags.RESULT)
    assert (ABORT_TAG, VERDICT_TAG, REQUEST_TAG) == (tags.ABORT, tags.VERDICT, tags.REQUEST)
    assert (EXCHANGE_TAG, LANE_TAG, P2P_TAG) == (tags.EXCHANGE, tags.LANE_OFFER, tags.P2P)
    control = [tags.ABORT, tags.VERDICT, tags.REQUEST, tags.EXCHANGE, tags.LANE_OFFER]
    assert min(control) >= tags.RANGES["RESULT"][1]  # a stage floor never drops control


def test_control_events_round_trip_and_malformed_ones_are_named() -> None:
    from aioreduce.wire import control as c

    events: list[c.Control] = [c.Register("10.0.0.1", 4000, 13),
                               c.Table((("10.0.0.1", 4000), ("10.0.0.2", 4001))),
                               c.Table((("10.0.0.1", 4000),), (2,), 3),
                               c.Abort("ranks missing", (3, 4)), c.Arrive(), c.Release(),
                               c.Abort("barrier failed", (2,), 7), c.Arrive(3), c.Release(5),
                               c.Notice("rank 2 failed")]
    for event in events:  # through msgpack, as a frame carries them
        meta = msgpack.unpackb(msgpack.packb(c.encode(event)), raw=False)
        assert c.decode(meta) == event
    for bad in ({"op": "register", "host": "h", "port": "80", "world": 2},
                {"op": "register", "host": "h", "port": True, "world": 2},
                {"op": "table", "table": [["h", 1], ["h"]]},
                {"op": "table", "table": [["h", 1]], "hosts": -1},
                {"op": "abort", "missing": ["3"]}, {"op": "barrier", "barrier": "1"},
                {"op": "release", "barrier": 1.5}, {"op": "junk"}, {}):
        with pytest.raises(c.MalformedControl):
            c.decode(bad)
    offer = c.LaneOffer(4000, "ab" * 16, "aioreduce-lane-" + "cd" * 16)
    assert c.decode_offer(c.offer_meta(offer)) == offer
    assert c.decode_offer({"port": 1, "nonce": "ab" * 16}) == c.LaneOffer(1, "ab" * 16)
    moved = c.LaneOffer(5, "ab" * 16, None, "10.0.0.9")  # a rank that rejoined elsewhere
    assert c.decode_offer(c.offer_meta(moved)) == moved
    for bad_offer in ({"port": 1, "nonce": "xy" * 16}, {"port": 1, "nonce": "ab"},
                      {"port": "1", "nonce": "ab" * 16}, {"port": 1, "nonce": "ab" * 16,
                                                          "unix": 5},
                      {"port": 1, "nonce": "ab" * 16, "host": 7}):
        with pytest.raises(c.MalformedControl):
            c.decode_offer(bad_offer)
    for reopen in (c.LaneReopen(7), c.LaneReopen(9, answer=True), c.LaneReopen(-1, True)):
        assert c.decode_reopen(c.reopen_meta(reopen)) == reopen
    for bad_reopen in ({"start": 7}, {"start": "7", "answer": False},
                       {"start": -2, "answer": True}, {"start": 7, "answer": 1}, {}):
        with pytest.raises(c.MalformedControl):
            c.decode_reopen(bad_reopen)


def test_a_step_failure_reads_back_and_an_unreadable_one_names_its_sender() -> None:
    from aioreduce.wire import control as c

    for event in (c.StepFailed("mismatch", "rank 3's vector differs", (1, 3)),
                  c.StepFailed("lost", "connection reset", rank=5)):
        assert c.decode_failed(c.failed_meta(event), sender=2) == event
    assert c.decode_failed({"kind": "?", "rank": "x"}, sender=2) == c.StepFailed("lost", "",
                                                                                 rank=2)
