"""Incarnations: which process of each rank a node talks to (sans-IO), the handshake that
carries them, and the control messages of a rejoin and a heal."""

from __future__ import annotations

import msgpack
import pytest

from aioreduce.wire import Header
from aioreduce.wire import control as c
from aioreduce.wire.handshake import (
    Accepted,
    ConnectorHandshake,
    ListenerHandshake,
    Proved,
    Refused,
)
from aioreduce.wire.incarnation import (
    JOINING,
    Incarnations,
    Newer,
    Same,
    Stale,
    Unregistered,
)


def test_rank0_numbers_replacements_only_once_the_job_runs() -> None:
    inc = Incarnations(0, 4)
    assert inc.judge(2, JOINING) == Same()  # the job's start: everyone is incarnation 0
    inc.running = True
    assert inc.judge(2, JOINING) == Newer(2, 1)  # a replacement registers
    assert inc.known == [0, 0, 1, 0]
    assert inc.judge(2, JOINING) == Newer(2, 2)  # and its replacement
    assert inc.judge(2, 2) == Same()


def test_an_older_incarnation_is_stale_and_a_newer_one_replaces() -> None:
    inc = Incarnations(3, 4)
    assert inc.judge(1, 0) == Same()
    assert inc.judge(1, 2) == Newer(1, 2)  # we missed incarnation 1: still the newest wins
    verdict = inc.judge(1, 1)
    assert verdict == Stale(1, 1, 2)
    assert isinstance(verdict, Stale) and "rank 1 (incarnation 1" in verdict.text("h:1")
    assert inc.known[1] == 2  # a stale claim changes nothing


def test_a_joining_process_dials_only_rank0_and_a_joining_listener_is_taken_as_it_is() -> None:
    inc = Incarnations(3, 4)
    assert inc.judge(1, JOINING) == Unregistered(1)
    assert inc.judge(1, JOINING, dialed=True) == Same()
    assert inc.known[1] == 0


def test_the_table_gives_a_process_its_number() -> None:
    inc = Incarnations(2, 4)
    inc.mine = JOINING
    inc.learn((0, 3, 1, 0))
    assert inc.mine == 1 and inc.rejoined and inc.known == [0, 3, 1, 0]
    fresh = Incarnations(2, 4)
    fresh.learn((0, 0, 0, 0))
    assert fresh.mine == 0 and not fresh.rejoined


def _run(conn: ConnectorHandshake, lis: ListenerHandshake,
         tamper: dict[str, object] | None = None) -> tuple[object, object]:
    hello = conn.start()
    if tamper:
        hello = Header(hello.kind, src=hello.src, meta={**hello.meta, **tamper})
    challenge, ev = lis.receive(hello)
    if ev is not None:
        return ev, None
    auth, proved = conn.receive(challenge[0])
    if not auth:
        return proved, None
    _welcome, accepted = lis.receive(auth[0])
    return proved, accepted


def test_the_handshake_carries_both_incarnations() -> None:
    proved, accepted = _run(ConnectorHandshake(b"s", "j", 2, 0, incarnation=JOINING),
                            ListenerHandshake(b"s", "j", 0, 4, incarnation=0))
    assert proved == Proved(0, 0) and accepted == Accepted(2, JOINING)
    proved, accepted = _run(ConnectorHandshake(b"s", "j", 2, 1, incarnation=3),
                            ListenerHandshake(b"s", "j", 1, 4, incarnation=5))
    assert proved == Proved(1, 5) and accepted == Accepted(2, 3)


def test_an_incarnation_changed_on_the_way_fails_the_proof() -> None:
    """The connector's claim is bound into its proof: a relay cannot make an old process
    pass for a new one."""
    _proved, accepted = _run(ConnectorHandshake(b"s", "j", 2, 0, incarnation=1),
                             ListenerHandshake(b"s", "j", 0, 4), tamper={"inc": 2})
    assert isinstance(accepted, Refused) and "proof" in accepted.reason


@pytest.mark.parametrize("bad", [-2, "1", True, 1.5])
def test_a_malformed_incarnation_is_refused(bad: object) -> None:
    ev, _ = _run(ConnectorHandshake(b"s", "j", 2, 0), ListenerHandshake(b"s", "j", 0, 4),
                 tamper={"inc": bad})
    assert isinstance(ev, Refused) and "incarnation" in ev.reason


def test_rejoin_and_heal_messages_round_trip_and_malformed_ones_are_named() -> None:
    events: list[c.Control] = [c.Table((("a", 1), ("b", 2)), (0, 4)), c.Moved(3, "h", 9, 2),
                               c.HealAsk(0, 0), c.HealAsk(2, 7), c.HealAsk(1, 3, join=True),
                               c.Reform((0, 1, 3), 12), c.ResultAsk(41),
                               c.Running((("a", 1), ("b", 2)), (1, 0), 2)]
    for event in events:
        meta = msgpack.unpackb(msgpack.packb(c.encode(event)), raw=False)
        assert c.decode(meta) == event
    assert {c.Notice.op, c.Moved.op, c.HealAsk.op, c.Reform.op,
            c.ResultAsk.op, c.Running.op} == c.OUT_OF_BAND
    for meta, says in [({"op": "moved", "rank": 1, "host": "h", "port": 1, "inc": 0},
                        "incarnation"),
                       ({"op": "heal", "inc": 1}, "ticket"),
                       ({"op": "reform", "members": [], "start": 3}, "members"),
                       ({"op": "reform", "members": [0, -1], "start": 3}, "members"),
                       ({"op": "reform", "members": [0, 1]}, "starts at"),
                       ({"op": "result", "step": -1}, "step it asks about"),
                       ({"op": "result", "step": "3"}, "step it asks about"),
                       ({"op": "table", "table": [["a", 1]], "inc": [-1]}, "incarnations"),
                       ({"op": "running", "table": [["a", 1]], "inc": []}, "incarnation per"),
                       ({"op": "running", "table": [["a", 1]], "inc": [-1]}, "incarnations")]:
        with pytest.raises(c.MalformedControl, match=says):
            c.decode(meta)



def test_a_new_rank_0_takes_rank_0s_next_number_from_a_live_ranks_table() -> None:
    inc = Incarnations(0, 4)
    inc.mine = JOINING  # a rank-0 process until its rendezvous knows the job runs
    inc.resume((2, 0, 3, 1))
    assert (inc.mine, inc.known, inc.running, inc.rejoined) == (3, [3, 0, 3, 1], True, True)
    assert inc.judge(2, JOINING) == Newer(2, 4)  # it hands out the next numbers


def test_staleness_is_checked_without_changing_anything() -> None:
    inc = Incarnations(0, 4)
    inc.known[3] = 2
    assert inc.stale(3, 1) == Stale(3, 1, 2) and inc.stale(3, 0) == Stale(3, 0, 2)
    assert inc.stale(3, 2) is None and inc.stale(3, 5) is None and inc.stale(3, JOINING) is None
    assert inc.known[3] == 2


def test_hosts_are_counted_as_named_with_localhost_as_127_0_0_1() -> None:
    from aioreduce.transport.rendezvous import count_hosts

    assert count_hosts(["localhost", "127.0.0.1", "::1"]) == 1
    assert count_hosts(["10.0.0.1", "10.0.0.1", "10.0.0.2"]) == 2
    assert count_hosts(["127.0.0.1", "127.0.0.2"]) == 2  # a test's second "host"


def test_a_new_rank_0_serves_a_replacement_that_reached_it_before_the_word_the_job_runs() -> None:
    """Rank 0 and rank 2 die together. Rank 2's replacement reaches the new rank 0 first, but
    its registration is still on the way when a live rank says the job runs: the new rank 0
    must serve it as a rejoin (its registration read later, the table sent, the others told),
    not leave it waiting for a table (it once did: the registration then sat unread until
    the job's last barrier, which it failed)."""
    import asyncio
    from typing import Any

    from aioreduce.transport.rendezvous import _resume

    class FakeMesh:
        def __init__(self) -> None:
            self.rank, self.world_size, self.hosts = 0, 4, 1
            self.addresses: dict[int, tuple[str, int]] = {0: ("h0", 1)}
            self.incarnations = Incarnations(0, 4)
            self.incarnations.mine = JOINING
            self.on_joining: Any = None
            # Only rank 2 dialed this process claiming no incarnation (the live ranks 1
            # and 3 claim theirs).
            self.joined_early = {2}
            self.sent: list[tuple[int, c.Control]] = []
            self.tasks: list[asyncio.Task[None]] = []
            self.registered = asyncio.Event()

        def connected(self, rank: int) -> bool:
            return True

        def set_address(self, rank: int, address: tuple[str, int]) -> None:
            self.addresses[rank] = address

        async def send_control(self, rank: int, event: c.Control) -> None:
            self.sent.append((rank, event))

        def spawn(self, coro: Any) -> None:
            self.tasks.append(asyncio.get_running_loop().create_task(coro))

        async def recv_control(self, rank: int, timeout: float | None = None) -> c.Control:
            assert rank == 2
            await self.registered.wait()  # its registration comes after the word
            return c.Register("h9", 9, 4)

    async def body() -> None:
        mesh = FakeMesh()
        running = c.Running((("h0", 1), ("h1", 1), ("h2", 2), ("h3", 3)), (0, 0, 0, 0), 1)
        await _resume(mesh, running, {}, 5.0)  # type: ignore[arg-type]
        assert mesh.incarnations.known == [1, 0, 1, 0]
        assert all(r != 2 for r, _e in mesh.sent)  # not told rank 0 moved: it has no table
        mesh.registered.set()
        await asyncio.gather(*mesh.tasks)
        tables = [e for r, e in mesh.sent if r == 2]
        assert len(tables) == 1 and isinstance(tables[0], c.Table)
        assert tables[0].incarnations == (1, 0, 1, 0) and tables[0].addresses[2] == ("h9", 9)
        told = {r for r, e in mesh.sent if isinstance(e, c.Moved) and e.rank == 2}
        assert told == {1, 3}

    asyncio.run(body())
