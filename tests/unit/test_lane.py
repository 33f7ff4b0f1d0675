"""One lane (``transport/lane.py``) on a real socket pair: what the sender thread finds queued
goes out in one call, in order and exact, also when the kernel takes it piece by piece; what
was lent and not sent yet is copied on release, the peer reading or not."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from aioreduce.transport.lane import Lane


class _Counting(socket.socket):
    """A socket that counts its sendmsg calls and the buffers of each; ``most``: it takes at
    most that many bytes a call (a partial send, as a signal would cause)."""

    calls: list[int]
    most: int | None = None

    def sendmsg(self, buffers, *args):  # type: ignore[no-untyped-def, override]
        bufs = [memoryview(b).cast("B") for b in buffers]
        self.calls.append(len(bufs))
        if self.most is not None:
            left, cut = self.most, []
            for b in bufs:
                if not left:
                    break
                cut.append(b[:left])
                left -= len(cut[-1])
            bufs = cut
        return super().sendmsg(bufs, *args)


def _pair(most: int | None) -> tuple[Lane, Lane, _Counting]:
    a, b = socket.socketpair()
    counting = _Counting(a.family, a.type, fileno=a.detach())
    counting.calls, counting.most = [], most
    return Lane(counting, 1), Lane(b, 0), counting


def _stream(most: int | None, count: int = 120, size: int = 64 << 10) -> list[int]:
    sender, receiver, sock = _pair(most)
    messages = [np.full(size, i % 251, np.uint8) for i in range(count)]
    try:
        # Every message is queued before anything is read: the first fills the socket's
        # buffer and the sender thread blocks on it with the rest queued behind.
        for i, m in enumerate(messages):
            sender.send(7, i, m.data)
        got = np.empty(size, np.uint8)
        for i in range(count):
            assert receiver.read_head() == (7, i, size, 0)
            receiver.read_into(got.data)
            assert np.array_equal(got, messages[i]), f"message {i} altered"
        assert sender.flush(timeout=10)
        assert sender.sent == count
        return sock.calls
    finally:
        sender.close()
        receiver.close()


def test_a_queue_of_messages_goes_out_in_order_in_few_calls() -> None:
    calls = _stream(None)
    assert len(calls) < 120 and max(calls) > 2  # some call carried several messages


def test_what_the_kernel_did_not_take_is_sent_again_in_order() -> None:
    calls = _stream(most=777, count=20, size=5000)
    assert len(calls) > 20 * 5000 // 777  # the partial path was taken


def test_close_ends_the_sender_thread_with_messages_queued_behind() -> None:
    sender, receiver, _sock = _pair(None)
    big = np.zeros(1 << 20, np.uint8)
    for i in range(8):
        sender.send(1, i, big.data)
    receiver.close()  # the sender thread is blocked or fails: close must still end it
    sender.close()
    assert not any(t.name == "aioreduce-lane-to-1" and t.is_alive()
                   for t in threading.enumerate())


def test_release_copies_what_a_peer_not_reading_has_not_taken_yet() -> None:
    sender, receiver, _sock = _pair(None)
    vector = np.arange(4 << 20, dtype=np.uint8)  # far more than the socket holds
    want = vector.copy()
    try:
        with pytest.raises(ValueError, match="allow_lending"):
            sender.send(3, 0, vector[:8].data, lent=True)
        sender.allow_lending()
        for i in range(4):
            sender.send(3, i, vector[i << 20:(i + 1) << 20].data, lent=True)
        assert sender.unsent > 0  # the peer reads nothing: most of it is still ours
        sender.release()  # returns although the peer still does not read
        vector[:] = 0xFF  # the caller's array changes: what was lent must not
        got = np.empty(1 << 20, np.uint8)
        for i in range(4):
            assert receiver.read_head() == (3, i, 1 << 20, 0)
            receiver.read_into(got.data)
            assert np.array_equal(got, want[i << 20:(i + 1) << 20]), f"message {i} altered"
        assert sender.flush(timeout=10) and sender.unsent == 0
        sender.release()  # nothing lent any more: nothing to do
    finally:
        sender.close()
        receiver.close()
