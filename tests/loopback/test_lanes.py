"""Lanes (blocking bulk streams between two ranks, see aioreduce/transport/lane.py) on real
sockets on 127.0.0.1: only a peer that proves the secret gets one, whatever else connects
first; messages arrive exact, small ones read ahead with their heads; a blocked receive is
released by an interrupt from another thread, a wait for bytes by a wake (the lane stays
usable); two meshes open a pair each way. What a message fills is the matcher's
(tests/unit/test_lane_links.py).
Lanes between ranks on one host are Unix sockets (abstract names) unless the mesh says not;
a sender that finds no such name (another host or network namespace) dials TCP.
The ring over lanes between processes is tested with the ring (its default) in test_schemes,
callerprog (vector mismatches) and the torch tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from aioreduce.errors import ConfigError, PeerLost
from aioreduce.settings import env_extras
from aioreduce.transport import Mesh, MeshOptions
from aioreduce.transport.lane import (
    LOCAL_PREFIX,
    PROOF_BYTES,
    SPIN_S,
    Lane,
    LaneListener,
    dial,
    local_name,
    proof,
)
from aioreduce.transport.mesh import spin_for
from aioreduce.wire import byte_view

pytestmark = pytest.mark.loopback

SECRET = b"lane secret"


NONCE = b"n" * 16
# A wrong secret, a valid proof for another pair of ranks, too few bytes then silence, far too
# many bytes, and nothing at all.
HOSTILE: list[bytes | None] = [proof(b"another secret", NONCE, 1, 0), proof(SECRET, NONCE, 2, 0),
                               b"short", b"x" * (PROOF_BYTES * 100), None]


def _recv(lane: Lane, step: int, index: int, out: memoryview) -> None:
    """Read the next message into ``out`` (a matcher's way, without the matcher)."""
    head = lane.read_head()
    assert head == (step, index, out.nbytes, 0)
    lane.read_into(out)


def _round_trip(sender: Lane, receiver: Lane, step: int, index: int,
                check: Callable[[], bool] = lambda: True) -> None:
    """A small message from ``sender`` arrives exact at ``receiver`` (``check`` in between)."""
    arr = np.arange(10.0)
    sender.send(step, index, byte_view(arr))
    assert check()
    out = np.empty_like(arr)
    _recv(receiver, step, index, byte_view(out))
    assert (out == arr).all()


def _count_polls(lane: Lane) -> list[int]:
    """The ``unit`` of every ``wait_readable`` call on ``lane`` from now on (its polls)."""
    polls: list[int] = []
    poll = lane.wait_readable

    def counted(unit: int = 1) -> bool:
        polls.append(unit)
        return poll(unit)

    lane.wait_readable = counted  # type: ignore[method-assign]
    return polls


def _intrude(listener: LaneListener, hostile: list[bytes | None]) -> list[socket.socket]:
    """Connect ``hostile`` to the listener, alternating its TCP port and its Unix name."""
    out = []
    for i, payload in enumerate(hostile):
        if listener.unix is not None and i % 2:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(b"\0" + listener.unix.encode())
        else:
            s = socket.create_connection(("127.0.0.1", listener.port))
        if payload is not None:
            s.sendall(payload)
        out.append(s)
    return out


def _pair(hostile: list[bytes | None] | None = None, local: bool = False) -> tuple[Lane, Lane]:
    """A lane from rank 1 to rank 0 (a Unix socket if ``local``); ``hostile`` connections
    (their bytes, None: silent) reach the listener first and stay connected. Each may take
    20 s to prove itself, as long as the whole opening may: a listener that read them one by
    one would time out."""
    listener = LaneListener("127.0.0.1", peer=1, local=local)
    intruders = _intrude(listener, hostile or [])
    got: list[Lane] = []
    accepting = threading.Thread(target=lambda: got.append(
        listener.accept(proof(SECRET, NONCE, 1, 0), timeout=20, proof_timeout=20)))
    accepting.start()
    sender = dial("127.0.0.1", listener.port, proof(SECRET, NONCE, 1, 0), 0, timeout=20,
                  unix=listener.unix)
    accepting.join(30)
    for s in intruders:  # none was answered: closed by the listener (reset if it sent more)
        s.settimeout(20)
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(1) == b""
        s.close()
    (receiver,) = got
    assert sender.local == receiver.local == local  # the path meant
    return sender, receiver


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "unix"])
def test_without_the_secret_no_lane_opens(local: bool) -> None:
    listener = LaneListener("127.0.0.1", peer=1, local=local)
    intruders = _intrude(listener, HOSTILE)
    with pytest.raises(PeerLost, match="rank 1 did not open its lane"):
        listener.accept(proof(SECRET, NONCE, 1, 0), timeout=1.0, proof_timeout=0.5)
    # Every one was read (at most PROOF_BYTES each) and refused, the silent ones on time.
    assert listener.refused == len(HOSTILE)
    for s in intruders:
        s.close()


@pytest.mark.parametrize("started", [True, False], ids=["accepting", "before-accept"])
def test_closing_a_listener_ends_its_accept_at_once(started: bool) -> None:
    """An opening given up (its step failed elsewhere) closes its listeners from the loop's
    thread: an accept in progress on another thread ends then, not at its timeout (its
    thread kept a process from exiting for up to 30 s after a tolerated death)."""
    listener = LaneListener("127.0.0.1", peer=1, local=True)
    outcome: list[BaseException] = []
    entered = threading.Event()

    def accept() -> None:
        entered.set()
        try:
            listener.accept(proof(SECRET, NONCE, 1, 0), timeout=60.0)
        except BaseException as exc:  # (what the test inspects)
            outcome.append(exc)

    thread = threading.Thread(target=accept)
    if started:
        thread.start()
        entered.wait(10)
        limit = time.monotonic() + 10
        while not listener._accepting:  # the accept has begun (its selector registered)
            assert time.monotonic() < limit
            time.sleep(0.001)
        listener.close()
    else:
        listener.close()
        thread.start()
    thread.join(10)  # a bound for a failing test only: a working close ends it at once
    assert not thread.is_alive()
    (exc,) = outcome
    assert isinstance(exc, PeerLost) and "given up" in str(exc)


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "unix"])
def test_only_the_secret_opens_a_lane_and_messages_arrive_exact(local: bool) -> None:
    sender, receiver = _pair(HOSTILE, local)
    try:
        data = [np.random.default_rng(i).standard_normal(n) for i, n in
                enumerate([0, 1, 100_000, 3_000_000])]
        for i, arr in enumerate(data):
            sender.send(7, i, byte_view(arr))
        for i, arr in enumerate(data):
            out = np.empty_like(arr)
            _recv(receiver, 7, i, byte_view(out))
            assert (out == arr).all()
        assert sender.flush(30)
    finally:
        sender.close()
        receiver.close()


def test_interrupt_releases_a_blocked_receive_and_a_closed_peer_is_named() -> None:
    sender, receiver = _pair()
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            _recv(receiver, 0, 0, byte_view(np.zeros(10)))
        except BaseException as exc:  # checked below
            errors.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    receiver.interrupt()  # from another thread, as a failed step elsewhere does
    t.join(30)
    assert not t.is_alive() and isinstance(errors[0], PeerLost)
    sender.close()
    receiver.close()
    sender2, receiver2 = _pair()
    sender2.close()  # the peer goes away
    with pytest.raises(PeerLost) as info:
        _recv(receiver2, 0, 0, byte_view(np.zeros(10)))
    assert info.value.rank == 1
    receiver2.close()


def test_a_wake_ends_a_wait_for_bytes_and_the_lane_stays_usable() -> None:
    sender, receiver = _pair()
    try:
        woken: list[bool] = []
        t = threading.Thread(target=lambda: woken.append(receiver.wait_readable()))
        t.start()
        receiver.wake()  # from another thread, as a withdrawn receive does
        t.join(30)
        assert woken == [False]
        receiver.wake()  # a wake before the wait ends that wait as well
        assert receiver.wait_readable() is False
        _round_trip(sender, receiver, 4, 2, check=lambda: receiver.wait_readable() is True)
    finally:
        sender.close()
        receiver.close()


def test_small_messages_are_read_ahead_with_their_heads() -> None:
    """One read takes several small messages (head and payload): the next head and payload
    need no call, and a large payload is read past what was read ahead. (A Unix socket: what
    was sent is in the receiver's queue once flushed.)"""
    sender, receiver = _pair(local=True)
    try:
        small = [np.full(100, i, np.float64) for i in range(3)]
        big = np.random.default_rng(0).standard_normal(200_000)
        for i, arr in enumerate([*small, big]):
            sender.send(5, i, byte_view(arr))
        assert sender.flush(30)
        for i, arr in enumerate([*small, big]):
            out = np.empty_like(arr)
            _recv(receiver, 5, i, byte_view(out))
            assert (out == arr).all()
            if i < 2:
                assert receiver.buffered > 0  # the path under test: the rest was read ahead
        assert receiver.buffered == 0
    finally:
        sender.close()
        receiver.close()


def test_a_head_after_a_large_message_is_read_without_a_poll() -> None:
    """wait_head (an in-order receive's wait): after a large message the next head is read
    at once if it is in (a stream of them); otherwise, and before the first, it polls, so a
    wake ends it and nothing raises for a read that found nothing."""
    sender, receiver = _pair(local=True)
    polls = _count_polls(receiver)
    try:
        big = [np.random.default_rng(i).standard_normal(100_000) for i in range(2)]
        for i, arr in enumerate(big):
            sender.send(6, i, byte_view(arr))
        assert sender.flush(30)
        for i, arr in enumerate(big):
            assert receiver.wait_head() is True
            out = np.empty_like(arr)
            _recv(receiver, 6, i, byte_view(out))
            assert (out == arr).all()
        assert len(polls) == 1  # the path under test: the second head came without a poll
        receiver.wake()
        assert receiver.wait_head() is False  # nothing in: it polled, and the wake ended it
        assert len(polls) == 2
        _round_trip(sender, receiver, 7, 0, check=lambda: receiver.wait_head() is True)
    finally:
        sender.close()
        receiver.close()


def test_with_spin_a_head_that_comes_is_read_without_a_poll_and_a_wake_still_ends_it(
        ) -> None:
    """Lane.spin: wait_head reads without blocking first (a rank with a core of its own: a
    reply is likely that soon), so a message that comes meanwhile is read without the poll;
    a wake during the spin is seen by the poll after it (False), and the lane stays usable."""
    sender, receiver = _pair(local=True)
    polls = _count_polls(receiver)
    try:
        receiver.spin = 60.0  # (longer than the test: it ends when the message comes)
        answer: list[bool] = []
        waiting = threading.Thread(target=lambda: answer.append(receiver.wait_head()))
        waiting.start()
        arr = np.arange(10.0)
        sender.send(9, 0, byte_view(arr))
        waiting.join(60)
        assert answer == [True] and polls == []  # the path under test: read by the spin
        out = np.empty_like(arr)
        assert receiver.take_bare(9, 0, byte_view(out)) and (out == arr).all()
        receiver.spin = 0.001
        receiver.wake()
        assert receiver.wait_head() is False  # spun, nothing came, then the poll saw the wake
        assert len(polls) == 1
        _round_trip(sender, receiver, 10, 0, check=lambda: receiver.wait_head() is True)
    finally:
        sender.close()
        receiver.close()


def test_lanes_spin_only_where_each_rank_has_a_core() -> None:
    """The mesh's lanes spin (``SPIN_S``) where this host's ranks have a core each, not where
    they share cores; ``MeshOptions.lane_spin`` and ``AIOREDUCE_LANE_SPIN`` decide instead."""
    assert spin_for(1, 1) == spin_for(8, 16) == SPIN_S > 0
    assert spin_for(13, 2) == spin_for(3, 2) == 0.0
    mesh = Mesh(0, 3, SECRET, "job", MeshOptions())
    mesh.addresses = {0: ("10.0.0.1", 1), 1: ("10.0.0.1", 2), 2: ("10.0.0.2", 3)}
    cores = len(os.sched_getaffinity(0))
    assert mesh.lane_spin() == (SPIN_S if cores >= 2 else 0.0)  # two ranks on 10.0.0.1
    mesh.addresses = {r: ("127.0.0.1", r) for r in range(cores + 1)}
    assert mesh.lane_spin() == 0.0
    assert Mesh(0, 3, SECRET, "job", MeshOptions(lane_spin=0.25)).lane_spin() == 0.25
    assert env_extras({"AIOREDUCE_LANE_SPIN": "0"})["options"].lane_spin == 0.0
    with pytest.raises(ConfigError, match="AIOREDUCE_LANE_SPIN"):
        env_extras({"AIOREDUCE_LANE_SPIN": "soon"})


def test_take_bare_copies_only_the_whole_expected_bare_message() -> None:
    """An in-order receive's one-call path: the next message read ahead whole, bare, of the
    size and (step, index) expected; anything else leaves the lane as it was for the general
    read (another index, another size, meta, a message not wholly in)."""
    sender, receiver = _pair(local=True)
    try:
        small = np.arange(16.0)
        sender.send(8, 0, byte_view(small))
        sender.send(8, 1, byte_view(small), b"meta")
        big = np.random.default_rng(1).standard_normal(100_000)
        sender.send(8, 2, byte_view(big))
        assert sender.flush(30)
        out = np.zeros(16)
        assert receiver.wait_head() is True
        held = receiver.buffered
        assert not receiver.take_bare(8, 1, byte_view(out))  # another index
        assert not receiver.take_bare(8, 0, byte_view(np.zeros(8)))  # another size
        assert receiver.buffered == held and (out == 0).all()
        assert receiver.take_bare(8, 0, byte_view(out))
        assert (out == small).all()
        assert not receiver.take_bare(8, 1, byte_view(out))  # it has meta: the general way
        assert receiver.read_head() == (8, 1, small.nbytes, 4)
        assert receiver.read_meta(4) == b"meta"
        receiver.read_into(byte_view(out))
        assert (out == small).all()
        got = np.empty_like(big)
        assert not receiver.take_bare(8, 2, byte_view(got))  # not wholly read ahead
        _recv(receiver, 8, 2, byte_view(got))
        assert (got == big).all()
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "unix"])
async def test_two_meshes_open_lanes_each_way_through_their_connection(local: bool) -> None:
    meshes = [Mesh(r, 2, SECRET, "job", MeshOptions(local_unix=local)) for r in range(2)]
    try:
        addrs = [await m.listen("127.0.0.1") for m in meshes]
        for m in meshes:
            m.addresses = {0: addrs[0], 1: addrs[1]}
        # On two ranks the successor and the predecessor are the same peer: two lanes.
        (out0, in0), (out1, in1) = await asyncio.gather(meshes[0].open_lanes(1, 1, step=3),
                                                        meshes[1].open_lanes(0, 0, step=3))
        a, b = np.arange(1000.0), -np.arange(1000.0)
        out0.send(3, 0, byte_view(a))
        out1.send(3, 0, byte_view(b))
        got0, got1 = np.empty(1000), np.empty(1000)
        await asyncio.gather(asyncio.to_thread(_recv, in0, 3, 0, byte_view(got0)),
                             asyncio.to_thread(_recv, in1, 3, 0, byte_view(got1)))
        assert (got0 == b).all() and (got1 == a).all()
        assert [lane.local for lane in (out0, in0, out1, in1)] == [local] * 4
        for lane in (out0, in0, out1, in1):
            lane.close()
    finally:
        for m in meshes:
            await m.close()


async def test_a_lane_offer_that_never_comes_is_named() -> None:
    """Rank 0 opens lanes with rank 1 at step 3; rank 1 never does (it is not at that step,
    or not opening lanes): the error names both ranks and the step, not a bare timeout."""
    meshes = [Mesh(r, 2, SECRET, "job", MeshOptions()) for r in range(2)]
    try:
        addrs = [await m.listen("127.0.0.1") for m in meshes]
        for m in meshes:
            m.addresses = {0: addrs[0], 1: addrs[1]}
        with pytest.raises(TimeoutError, match="rank 0: rank 1 sent no lane offer for step 3"):
            await meshes[0].open_lanes(1, 1, step=3, timeout=0.2)
    finally:
        for m in meshes:
            await m.close()


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "unix"])
def test_unacked_counts_what_the_peer_has_not_taken_until_it_does(local: bool) -> None:
    """What ``Mesh.drained`` waits for over lanes: bytes our sender thread holds or the kernel
    has not had acknowledged, 0 once the receiver read them all."""
    sender, receiver = _pair(local=local)
    try:
        assert sender.unacked() == 0
        big = np.arange(4 << 20, dtype=np.uint8)  # more than a loopback socket buffers
        sender.send(0, 0, byte_view(big))
        assert sender.unacked() > 0  # nobody reads yet: queued here or in the kernel
        out = np.empty_like(big)
        _recv(receiver, 0, 0, byte_view(out))
        assert sender.flush(30) and (out == big).all()
        limit = time.monotonic() + 30  # the last acknowledgement may be delayed a little
        while sender.unacked():
            assert time.monotonic() < limit, sender.unacked()
            time.sleep(0.001)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "unix"])
def test_a_small_message_goes_from_the_callers_thread_and_its_rest_keeps_the_order(
        local: bool) -> None:
    """An idle lane hands a small message to the kernel at once (no sender thread is woken);
    what the kernel cannot take goes to the sender thread, ahead of what is queued next."""
    sender, receiver = _pair(local=local)
    try:
        small = [np.full(1000, i, np.float64) for i in range(3)]
        for i, arr in enumerate(small):
            sender.send(1, i, byte_view(arr))
        assert sender._sender is None and sender.sent == 3  # the path under test: inline
        # A send buffer far smaller than the message: the kernel takes part of it (what the
        # receiver's window admits), the rest queues. (A receive buffer as small made TCP
        # crawl: the figure is in docs/status.md, stop 72.)
        sender.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        for i, arr in enumerate(small):
            out = np.empty_like(arr)
            _recv(receiver, 1, i, byte_view(out))
            assert (out == arr).all()
        parts = [np.random.default_rng(i).standard_normal(125_000) for i in range(3)]  # 1 MB
        for i, arr in enumerate(parts):
            sender.send(2, i, byte_view(arr))
        assert sender._sender is not None  # the rest of the first went to the thread
        for i, arr in enumerate(parts):
            out = np.empty_like(arr)
            _recv(receiver, 2, i, byte_view(out))
            assert (out == arr).all()
        assert sender.flush(30) and sender.sent == 6
    finally:
        sender.close()
        receiver.close()


def test_a_name_that_is_not_here_means_tcp() -> None:
    """A peer on another host (or in another network namespace) offers a name that does not
    exist here: the sender dials the TCP port instead, and the lane works."""
    listener = LaneListener("127.0.0.1", peer=1)  # no Unix side: its name is nowhere
    absent = LOCAL_PREFIX + "0" * 32
    got: list[Lane] = []
    accepting = threading.Thread(target=lambda: got.append(
        listener.accept(proof(SECRET, NONCE, 1, 0), timeout=20)))
    accepting.start()
    sender = dial("127.0.0.1", listener.port, proof(SECRET, NONCE, 1, 0), 0, timeout=20,
                  unix=absent)
    accepting.join(30)
    (receiver,) = got
    try:
        assert not sender.local and not receiver.local
        _round_trip(sender, receiver, 0, 0)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("offer", [None, 5, "", LOCAL_PREFIX, LOCAL_PREFIX + "g" * 32,
                                   LOCAL_PREFIX + "0" * 31, "other-" + "0" * 32,
                                   LOCAL_PREFIX + "0" * 32 + "\0x"])
def test_an_offered_name_of_another_shape_is_refused(offer: object) -> None:
    assert local_name(offer) is None
    assert local_name(LOCAL_PREFIX + "0123456789abcdef" * 2) is not None

