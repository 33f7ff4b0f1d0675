"""The healer's serving side over a fake mesh: answers at a step boundary or at once inside a
step, one state at a time, never to a replaced process; and the order of peers to ask."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from aioreduce.heal import Healer, StateHooks, _decide, sources
from aioreduce.wire import tags
from aioreduce.wire.control import HealAsk
from aioreduce.wire.incarnation import Incarnations

from . import clockloop


class FakeMesh:
    """What the healer uses of a mesh; sends block until the test lets them through."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.barriers = 1, 4, 3
        self.incarnations = Incarnations(1, 4)
        self.on_heal: Any = None
        self.sent: list[tuple[int, int, int, bytes, dict[str, Any] | None]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.tasks: list[asyncio.Task[None]] = []
        self.broken: set[int] = set()  # ranks whose connection broke

    def is_lost(self, rank: int) -> bool:
        return rank in self.broken

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        await self.gate.wait()
        self.sent.append((rank, step, tag, bytes(array), meta))

    def spawn(self, coro: Any) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coro))


def _healer(mesh: FakeMesh) -> tuple[Healer, list[int]]:
    calls: list[int] = []

    def state() -> bytes:
        calls.append(1)
        return b"model-%d" % len(calls)

    hooks = StateHooks(state, lambda blob: None)
    return Healer(mesh, hooks, 5.0, lambda: [0, 2]), calls  # type: ignore[arg-type]


async def _settle(mesh: FakeMesh) -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_asks_wait_for_a_step_boundary_and_a_replaced_process_is_not_served() -> None:
    async def body() -> None:
        mesh = FakeMesh()
        healer, calls = _healer(mesh)
        mesh.incarnations.known[2] = 1
        mesh.on_heal(2, HealAsk(0, 0))  # the replaced process of rank 2: ignored
        mesh.on_heal(3, HealAsk(0, 7))
        await _settle(mesh)
        assert not mesh.sent and not calls  # between steps: nothing until the boundary
        healer.serve(12)
        await _settle(mesh)
        assert calls == [1]
        assert mesh.sent == [(3, 7, tags.HEAL, b"", {"step": 12, "nbytes": 7, "barriers": 3}),
                             (3, 7, tags.HEAL + 1, b"model-1", None)]

    asyncio.run(body())


def test_inside_a_step_asks_are_answered_at_once_one_state_at_a_time() -> None:
    async def body() -> None:
        mesh = FakeMesh()
        healer, calls = _healer(mesh)
        mesh.gate.clear()  # the first transfer does not get through yet

        async def run() -> Any:
            mesh.on_heal(2, HealAsk(0, 0))  # asked while this rank waits inside step 20
            await _settle(mesh)
            mesh.on_heal(3, HealAsk(0, 1))  # another ask while the first is on its way
            await _settle(mesh)
            assert calls == [1]  # one copy of the state at a time
            mesh.gate.set()
            await _settle(mesh)
            return "done"

        class Steps:
            step = 20

        await healer.step(Steps(), run, None)  # type: ignore[arg-type]
        await _settle(mesh)
        assert calls == [1, 1]
        heads = [(r, t, m["step"]) for r, t, tag, _b, m in mesh.sent if tag == tags.HEAL]
        assert heads == [(2, 0, 20), (3, 1, 20)]

    asyncio.run(body())


def test_sources_ask_the_neighbours_first() -> None:
    assert sources(5, 8, [6, 4]) == [4, 6, 0, 1, 2, 3, 7]
    assert sources(0, 3, []) == [1, 2]


ENV = {"AIOREDUCE_SECRET": "s3cret-for-tests", "AIOREDUCE_RANK": "0",
       "AIOREDUCE_WORLD_SIZE": "2", "AIOREDUCE_MASTER_ADDR": "127.0.0.1",
       "AIOREDUCE_MASTER_PORT": "4000"}


def test_the_environment_sets_how_long_a_step_waits_for_a_replacement() -> None:
    from aioreduce import Node

    async def body() -> None:
        assert Node.from_env({**ENV, "AIOREDUCE_REJOIN_WAIT": "2.5"}).healer.rejoin_wait == 2.5
        assert Node.from_env(ENV).healer.rejoin_wait == 0.0  # by default a step fails at once

    asyncio.run(body())


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_a_rejoin_wait_that_makes_no_sense_is_refused_by_name(value: str) -> None:
    from aioreduce import ConfigError, Node

    with pytest.raises(ConfigError, match=f"AIOREDUCE_REJOIN_WAIT='{value}'"):
        Node.from_env({**ENV, "AIOREDUCE_REJOIN_WAIT": value})


class AnsweringMesh(FakeMesh):
    """A fake mesh whose peers answer receives from a table ((rank, step, tag) -> meta); a
    receive nobody answers times out, as the mesh's does after its timeout."""

    def __init__(self, answers: dict[tuple[int, int, int], dict[str, Any]]) -> None:
        super().__init__()
        self.answers = answers

    async def recv_into(self, rank: int, out: np.ndarray, *, step: int, tag: int = 0,
                        timeout: float | None = None) -> Any:
        await asyncio.sleep(0)
        meta = self.answers.get((rank, step, tag))
        if meta is None:
            raise TimeoutError(f"nothing from rank {rank}")
        return type("Head", (), {"meta": meta})()


@pytest.mark.parametrize("theirs, outcome", [
    ({0: 9, 3: 9}, True),  # every live rank runs the group again from step 9
    ({0: 9, 3: 10}, "mismatch"),  # rank 3 finished a step the others did not
    ({0: 9}, False),  # rank 3 did not answer (died too): the caller raises its own error
])
def test_live_ranks_check_they_run_a_group_again_from_the_same_step(
        theirs: dict[int, int], outcome: object) -> None:
    from aioreduce.errors import GroupMismatch

    async def body() -> None:
        # This is rank 1 of 4; rank 2 (incarnation 0) died: the frames' key is 0 * 4 + 2.
        mesh = AnsweringMesh({(r, 2, tags.GROUP): {"at": s} for r, s in theirs.items()})
        healer, _calls = _healer(mesh)
        if outcome == "mismatch":
            with pytest.raises(GroupMismatch, match=r"rank 1: ranks \[2\] died .* \(rank 0 "
                               r"at step 9, rank 1 at step 9, rank 3 at step 10\)"):
                await healer._same_step({2: 0}, 9, 2)
        else:
            assert await healer._same_step({2: 0}, 9, 2) is outcome
        # Told every live peer where it runs the group again; nothing to the dead rank.
        assert sorted((r, s, t, m) for r, s, t, _b, m in mesh.sent) == [
            (0, 2, tags.GROUP, {"at": 9}), (3, 2, tags.GROUP, {"at": 9})]

    asyncio.run(body())


def test_a_groups_later_steps_fail_at_once_and_tell_the_peers() -> None:
    """After a death failed a step of a group (``rerun=False``), the group's later steps fail
    at once, without running, and each tells the peers it failed here (the session's
    ``tell_failed``): a peer that finished the failed step and waits in the next one would
    otherwise wait for this rank's part."""
    from aioreduce.errors import PeerLost
    from aioreduce.stepper import Stepper
    from aioreduce.straggle import StraggleModel

    async def body() -> None:
        mesh = FakeMesh()
        healer = Healer(mesh, None, 5.0, lambda: [0, 2], rejoin_wait=5.0)  # type: ignore[arg-type]
        steps = Stepper(1, 4, StraggleModel(), None, None)
        steps.step = 7
        death = PeerLost(2, "connection lost")
        told: list[tuple[int, BaseException]] = []
        ran: list[int] = []

        async def fails() -> Any:
            ran.append(steps.take())
            raise death

        async def never() -> Any:
            ran.append(steps.take())
            raise AssertionError("a later step of a failed group ran")

        class Telling:  # a session that can tell its peers (TellsFailure)
            def tell_failed(self, step: int, error: BaseException) -> None:
                told.append((step, error))

        session: Any = Telling()
        with pytest.raises(PeerLost):
            await healer.step(steps, fails, None, rerun=False, session=session)
        assert told == []  # the step that failed told its peers itself (the scheme's abort)
        for _later in range(2):
            with pytest.raises(PeerLost) as raised:
                await healer.step(steps, never, None, rerun=False, session=session)
            assert raised.value is death
        assert ran == [7] and told == [(8, death), (9, death)]
        assert steps.step == 10  # numbered as the ranks that ran them

    asyncio.run(body())


def test_a_ring_leaves_out_only_the_ranks_no_member_saw_replaced() -> None:
    members = (0, 1, 2, 3, 4)
    # Rank 0 decides: 2 and 4 missing here; rank 1 saw 4's replacement, rank 3 did not.
    theirs = {1: {"at": 9, "missing": [2]}, 3: {"at": 9, "missing": [2, 4]}}
    assert _decide(members, 0, [2, 4], 9, theirs) == {"members": [0, 1, 3, 4]}
    # A malformed proposal leaves nobody out; members at different steps are named.
    assert _decide(members, 0, [2], 9, {1: {"at": 9, "missing": "x"}}) == {
        "members": list(members)}
    assert _decide(members, 0, [2], 9, {1: {"at": 10, "missing": [2]}}) == {
        "at": {"1": 10, "0": 9}}


def test_a_rank_replaced_before_a_run_again_is_answered_when_that_run_fails_too() -> None:
    """A host lost takes ranks 2 and 3 of a 4-rank ring; 2's replacement comes first, the
    step runs again with it and fails on 3's death. Rank 0, the lowest member, must wait for
    and answer rank 2 too when the members agree after that second failure (it ran that run):
    it once took rank 2 for a rank replaced during the step (its incarnation had changed since
    the step's first run), answered only 1, and rank 2 waited for the decision while the others
    ran on without it (the spare-host test's flake)."""
    from aioreduce.errors import PeerLost
    from aioreduce.stepper import Stepper
    from aioreduce.straggle import StraggleModel

    class ReplacingMesh(AnsweringMesh):
        def __init__(self) -> None:
            super().__init__({})
            self.rank = 0
            self.incarnations = Incarnations(0, 4)
            self.on_reform: Any = None
            self.on_result_ask: Any = None

        def is_lost(self, rank: int) -> bool:
            return False

        async def replaced(self, rank: int, incarnation: int) -> None:
            self.incarnations.known[rank] = incarnation + 1  # its replacement rejoined

        async def connect(self, rank: int) -> None:
            return None

    class Ring:  # a session that re-forms (Reforms)
        members = (0, 1, 2, 3)

        def reform(self, members: Any, *, joined: bool = False) -> None:
            raise AssertionError("nobody was left out")

    async def body() -> None:
        mesh = ReplacingMesh()
        healer = Healer(mesh, None, 5.0, lambda: [1, 3], rejoin_wait=5.0)  # type: ignore[arg-type]
        steps = Stepper(0, 4, StraggleModel(), None, None)
        steps.step = 7
        deaths = [PeerLost(2, "connection lost"), PeerLost(3, "connection lost")]
        # The members' proposals, as their frames would bring them: after the first run
        # (step 7) from 1 and 3, after the second (step 8) from 1 and the replaced 2.
        mesh.answers = {(1, 8, tags.MEMBERS): {"at": 8, "missing": []},
                        (3, 8, tags.MEMBERS): {"at": 8, "missing": []},
                        (1, 9, tags.MEMBERS): {"at": 9, "missing": []},
                        (2, 9, tags.MEMBERS): {"at": 9, "missing": []}}

        async def run() -> Any:
            at = steps.take()
            if deaths:
                raise deaths.pop(0)
            return at

        session: Any = Ring()
        assert await healer.step(steps, run, None, session=session) == 9
        decisions = sorted((r, s) for r, s, t, _b, _m in mesh.sent if t == tags.MEMBERS + 1)
        # (2, 8) and (3, 9): the word goes to a rank replaced since the run began too (one
        # healed into the run waits for it; these came after, and leave it unread).
        assert decisions == [(1, 8), (1, 9), (2, 8), (2, 9), (3, 8), (3, 9)], decisions

    asyncio.run(body())


class GroupMesh(AnsweringMesh):
    """A fake mesh for a ring's groups of steps: replacements come when the test says
    (``back``), peers answer from the table, nobody is lost."""

    def __init__(self, rank: int, answers: dict[tuple[int, int, int], dict[str, Any]]
                 ) -> None:
        super().__init__(answers)
        self.rank = rank
        self.incarnations = Incarnations(rank, 4)
        self.on_reform: Any = None
        self.on_result_ask: Any = None
        self.back: set[int] = set()

    def is_lost(self, rank: int) -> bool:
        return False

    async def replaced(self, rank: int, incarnation: int) -> None:
        if rank not in self.back:
            await asyncio.Event().wait()  # never: the healer's wait times out
        self.incarnations.known[rank] = incarnation + 1

    async def connect(self, rank: int) -> None:
        return None

    async def send_control(self, rank: int, event: object) -> None:
        self.sent.append((rank, -1, -1, b"", {"control": event}))


class GroupRing:
    """A ring session that re-forms (Reforms), recording each change."""

    def __init__(self, members: tuple[int, ...]) -> None:
        self.members = members
        self.changes: list[tuple[int, ...]] = []

    def reform(self, members: Any, *, joined: bool = False) -> None:
        self.members = tuple(members)
        self.changes.append(self.members)


def test_a_replacement_healed_into_the_run_that_failed_hears_the_members_decision() -> None:
    """Rank 2's replacement rejoins while the ring runs a step again, and a peer inside that
    run heals it into it at once; the run then fails on rank 2's old process (the peer gave
    up its lane to it). Rank 2's replacement ran the run, so it waits for the members'
    decision too: rank 0, the lowest member, sends it there as well, though it did not wait
    for its word (it once did not, and the replacement waited while the others ran on: the
    spare-host test's second flake)."""
    from aioreduce.errors import PeerLost
    from aioreduce.stepper import Stepper
    from aioreduce.straggle import StraggleModel

    async def body() -> None:
        mesh = GroupMesh(0, {(1, 8, tags.MEMBERS): {"at": 8, "missing": []},
                             (3, 8, tags.MEMBERS): {"at": 8, "missing": []}})
        mesh.back = {2}
        ring = GroupRing((0, 1, 2, 3))
        healer = Healer(mesh, None, 5.0, lambda: [1, 3], rejoin_wait=5.0,  # type: ignore[arg-type]
                        members=lambda: ring.members)
        steps = Stepper(0, 4, StraggleModel(), None, None)
        steps.step = 7
        runs: list[int] = []

        async def run() -> Any:
            runs.append(steps.take())
            if len(runs) == 1:
                mesh.incarnations.known[2] = 1  # its replacement came during the run
                raise PeerLost(2, "lane to rank 2: connection refused")
            return runs[-1]

        assert await healer.step(steps, run, None, session=ring) == 8
        decisions = sorted(r for r, s, t, _b, _m in mesh.sent if t == tags.MEMBERS + 1)
        assert decisions == [1, 2, 3] and ring.changes == []

    asyncio.run(body())


def test_a_group_whose_dead_rank_does_not_come_back_runs_again_over_the_live_ring() -> None:
    """A group's step (``rerun=False``: DistributedOptimizer's buckets) fails because rank 2
    of 4 died, and no replacement comes within ``rejoin_wait``: ``replace_lost`` does not
    give up (the caller would raise) but has the live ranks agree, through rank 0, to run
    the group again over ranks 0, 1 and 3, as a ring's step does."""
    from aioreduce.errors import PeerLost
    from aioreduce.stepper import Stepper
    from aioreduce.straggle import StraggleModel

    async def body() -> None:
        # The frames' keys: the group's check at rank 2's death (incarnation 0: 0 * 4 + 2),
        # the members' proposals at the step it runs again from (8).
        mesh = GroupMesh(0, {(1, 2, tags.GROUP): {"at": 8}, (3, 2, tags.GROUP): {"at": 8},
                             (1, 8, tags.MEMBERS): {"at": 8, "missing": [2]},
                             (3, 8, tags.MEMBERS): {"at": 8, "missing": [2]}})
        ring = GroupRing((0, 1, 2, 3))
        healer = Healer(mesh, None, 5.0, lambda: [1, 3], rejoin_wait=0.01,  # type: ignore[arg-type]
                        members=lambda: ring.members)
        steps = Stepper(0, 4, StraggleModel(), None, None)
        steps.step = 7

        async def dies() -> Any:
            steps.take()
            raise PeerLost(2, "connection lost")

        with pytest.raises(PeerLost):
            await healer.step(steps, dies, None, rerun=False, session=ring, last=True)
        assert await healer.replace_lost(steps) is True
        assert ring.changes == [(0, 1, 3)]
        decisions = sorted((r, m["members"]) for r, s, t, _b, m in mesh.sent
                           if t == tags.MEMBERS + 1 and m is not None)
        assert decisions == [(1, [0, 1, 3]), (3, [0, 1, 3])]

        async def runs() -> Any:
            return steps.take()

        assert await healer.step(steps, runs, None, rerun=False, session=ring) == 8

    asyncio.run(body())


@pytest.mark.parametrize("marked", [True, False])
def test_a_rank_left_out_of_a_groups_ring_is_taken_back(marked: bool) -> None:
    """Rank 1 of a ring that runs groups over 0, 1 and 3 (rank 2 was left out). Rank 0, the
    lowest member, announces the ring with rank 2's replacement from step 20 on: rank 1
    acknowledges. ``marked`` (the program marks each group's last step): rank 1 finishes its
    group (step 20 is inside it, so nothing changes there) and at the next group's first step
    takes rank 2 back; that group fails at once on every member (rank 2's first group may be
    laid out otherwise, as a DDP replacement's is). Not marked: where a group starts is not
    known, so rank 2 is taken back at step 20 itself, which fails at once. Either way the
    group runs again with rank 2 after ``replace_lost``, which does not wait (it is back)."""
    from aioreduce.errors import PeerLost
    from aioreduce.stepper import Stepper
    from aioreduce.straggle import StraggleModel
    from aioreduce.wire.control import Reform

    again_at = 23 if marked else 21

    async def body() -> None:
        # The check's key for rank 2's replacement (incarnation 1) taken back: 1 x 4 + 2,
        # 2^32 past any death's.
        mesh = GroupMesh(1, {(0, (1 << 32) + 6, tags.GROUP): {"at": again_at},
                             (3, (1 << 32) + 6, tags.GROUP): {"at": again_at},
                             (0, again_at, tags.MEMBERS + 1): {"members": [0, 1, 2, 3]}})
        mesh.incarnations.known[2] = 1  # the replacement rejoined (rank 0 told us)
        ring = GroupRing((0, 1, 3))
        healer = Healer(mesh, None, 5.0, lambda: [0, 3], rejoin_wait=0.01,  # type: ignore[arg-type]
                        members=lambda: ring.members)
        steps = Stepper(1, 4, StraggleModel(), None, None)
        steps.step = 19
        ran: list[int] = []

        async def runs() -> Any:  # (a result as a step's: a group's last one is kept)
            ran.append(steps.take())
            return SimpleNamespace(value=np.zeros(1), step=ran[-1], used=list(ring.members),
                                   late=[])

        await healer.step(steps, runs, None, rerun=False, session=ring)  # 19: a first step
        mesh.on_reform(0, Reform((0, 1, 2, 3), 20))
        await asyncio.sleep(0)
        assert [(r, s, t) for r, s, t, _b, _m in mesh.sent] == [(0, 20, tags.MEMBERS + 2)]
        if marked:
            await healer.step(steps, runs, None, rerun=False, session=ring, last=True)  # 20
            assert ring.changes == []  # inside the group: not yet
        # The next group (marked: taken back at its first step), or step 20: fails at once.
        for _step in range(20 if marked else 19, again_at - 1):
            with pytest.raises(PeerLost, match="taken back"):
                await healer.step(steps, runs, None, rerun=False, session=ring)
        assert ring.changes == [(0, 1, 2, 3)] and ran == ([19, 20] if marked else [19])
        assert await healer.replace_lost(steps) is True
        again = await healer.step(steps, runs, None, rerun=False, session=ring)
        assert again.step == again_at and again.used == [0, 1, 2, 3]

    asyncio.run(body())


def test_a_reformed_ring_sums_its_members_exactly_and_takes_a_rank_back() -> None:
    from aioreduce.schemes import Ring
    from aioreduce.schemes.base import Reforms

    from .memjob import Job

    async def body() -> None:
        job = Job(Ring(), 4)
        for s in job.sessions:
            assert isinstance(s, Reforms) and s.members == (0, 1, 2, 3)
        for r in (0, 1, 3):
            job.sessions[r].reform([0, 1, 3])  # type: ignore[attr-defined]
        got = await job.run(0, [0, 1, 3])
        want = sum(job.vector(r, 0) for r in (0, 1, 3))
        for r, res in got.items():
            assert not isinstance(res, BaseException), (r, res)
            assert res.used == [0, 1, 3] and res.late == [2]
            np.testing.assert_allclose(res.value, want, rtol=1e-12)
        for r in range(4):
            job.sessions[r].reform([0, 1, 2, 3])  # type: ignore[attr-defined]
        job.assert_exact(1, await job.run(1))
        with pytest.raises(ValueError, match="rank 2: a ring re-formed without this rank"):
            job.sessions[2].reform([0, 1, 3])  # type: ignore[attr-defined]

    asyncio.run(body())


def test_a_reformed_transpose_sums_its_members_and_names_ranks_not_positions() -> None:
    from aioreduce.schemes import Transpose
    from aioreduce.schemes.base import Reforms

    from .memjob import Job

    async def body() -> None:
        job = Job(Transpose(hadamard=False), 4, dim=64)
        for s in job.sessions:
            assert isinstance(s, Reforms) and s.members == (0, 1, 2, 3)
        for step in range(2):  # the second step over lanes-free links of the new ring
            for r in (0, 1, 3):
                job.sessions[r].reform([0, 1, 3])  # type: ignore[attr-defined]
            got = await job.run(step, [0, 1, 3])
            want = sum(job.vector(r, step) for r in (0, 1, 3))
            for r, res in got.items():
                assert not isinstance(res, BaseException), (r, res)
                assert res.used == [0, 1, 3] and res.late == [] and res.received == 1.0
                np.testing.assert_allclose(res.value, want, rtol=1e-12)
        for r in range(4):
            job.sessions[r].reform([0, 1, 2, 3])  # type: ignore[attr-defined]
        job.assert_exact(2, await job.run(2))

    asyncio.run(body())


class RollMesh(FakeMesh):
    """A fake mesh for a group's last step taken from a peer: the peers' answers on the
    ``ROLL`` tags come from a table ((rank, step, tag) -> (meta, payload)); control messages
    and sends are recorded."""

    def __init__(self, answers: dict[tuple[int, int, int], tuple[dict[str, Any], Any]]
                 ) -> None:
        super().__init__()
        self.answers = answers
        self.controls: list[tuple[int, object]] = []
        self.on_reform: Any = None
        self.on_result_ask: Any = None

    def is_lost(self, rank: int) -> bool:
        return rank == 2

    async def send_control(self, rank: int, event: object) -> None:
        self.controls.append((rank, event))

    def replaced(self, rank: int, incarnation: int) -> asyncio.Future[None]:
        return asyncio.get_running_loop().create_future()  # nobody is, in these tests

    async def recv_into(self, rank: int, out: np.ndarray, *, step: int, tag: int = 0,
                        timeout: float | None = None) -> Any:
        await asyncio.sleep(0)
        answer = self.answers.get((rank, step, tag))
        if answer is None:
            raise TimeoutError(f"nothing from rank {rank}")
        meta, payload = answer
        if payload is not None:
            out[...] = payload
        return type("Head", (), {"meta": meta, "src": rank})()


def _group(mesh: FakeMesh, at: int) -> tuple[Healer, Any, list[int]]:
    from aioreduce.stepper import Stepper
    from aioreduce.straggle import StraggleModel

    healer = Healer(mesh, None, 5.0, lambda: [0, 2], rejoin_wait=5.0)  # type: ignore[arg-type]
    steps = Stepper(1, 4, StraggleModel(), None, None)
    steps.step = at
    return healer, steps, []


def test_a_groups_last_step_that_failed_here_is_taken_from_a_peer_that_finished_it() -> None:
    """Rank 1's step 7, its group's last, failed because rank 2 died; rank 3 had finished it
    (rank 2's part had reached it), rank 0 had not: rank 1 asks the live ranks, takes rank
    3's result into its vector, and goes on as if its step had succeeded (the group's next
    step runs, it does not fail at once)."""
    from aioreduce.errors import PeerLost
    from aioreduce.schemes import Result
    from aioreduce.wire.control import ResultAsk

    async def body() -> None:
        total = np.arange(6, dtype=np.float64) * 4
        mesh = RollMesh({(0, 7, tags.ROLL): ({"have": False}, None),
                         (3, 7, tags.ROLL): ({"have": True, "used": [0, 1, 2, 3],
                                              "late": []}, None),
                         (3, 7, tags.ROLL + 1): ({}, total)})
        healer, steps, ran = _group(mesh, 7)
        into = np.ones(6)
        landed: list[tuple[int, int]] = []

        class Staged:  # a vector still being filled (a device tensor's pieces)
            def landed(self, lo: int, hi: int) -> None:
                landed.append((lo, hi))

            def final(self, lo: int, hi: int) -> None:
                pass

        async def fails() -> Any:
            ran.append(steps.take())
            raise PeerLost(2, "connection lost")

        async def runs() -> Any:
            ran.append(steps.take())
            return Result(into, ran[-1], [0, 1, 2, 3])

        res = await healer.step(steps, fails, into, rerun=False, last=True, arrival=Staged())
        assert landed == [(0, 6)]  # every piece in before the result is written over them
        assert res.step == 7 and res.used == [0, 1, 2, 3] and res.value is into
        assert np.array_equal(into, total) and healer.rolled == 1
        assert sorted(mesh.controls) == [(0, ResultAsk(7)), (3, ResultAsk(7))]  # not rank 2
        await healer.step(steps, runs, into, rerun=False)  # the next group's step runs
        assert ran == [7, 8]

    asyncio.run(body())


def test_a_groups_last_step_that_no_live_rank_finished_fails_as_before() -> None:
    from aioreduce.errors import PeerLost

    async def body() -> None:
        mesh = RollMesh({(r, 7, tags.ROLL): ({"have": False}, None) for r in (0, 3)})
        healer, steps, ran = _group(mesh, 7)
        death = PeerLost(2, "connection lost")

        async def fails() -> Any:
            ran.append(steps.take())
            raise death

        with pytest.raises(PeerLost):
            await healer.step(steps, fails, np.ones(6), rerun=False, last=True)
        with pytest.raises(PeerLost) as raised:  # the group failed: its later steps at once
            await healer.step(steps, fails, np.ones(6), rerun=False)
        assert raised.value is death and ran == [7] and healer.rolled == 0

    asyncio.run(body())


def test_a_finished_last_step_is_sent_to_a_peer_that_asks_once_it_ended_here() -> None:
    """The serving side: an ask that comes while step 7 still runs here is answered when it
    ends; the result is a copy kept until a later group step succeeds; a step that failed
    here is answered with no."""
    from aioreduce.errors import PeerLost
    from aioreduce.schemes import Result
    from aioreduce.wire.control import ResultAsk

    async def body() -> None:
        mesh = RollMesh({})
        healer, steps, ran = _group(mesh, 7)
        into = np.zeros(4)
        go = asyncio.Event()

        async def runs() -> Any:
            ran.append(steps.take())
            await go.wait()
            into[:] = [1, 2, 3, 4]
            return Result(into, ran[-1], [0, 1, 2, 3])

        step = asyncio.ensure_future(healer.step(steps, runs, into, rerun=False, last=True))
        await _settle(mesh)
        mesh.on_result_ask(0, ResultAsk(7))  # asked while step 7 runs here
        await _settle(mesh)
        assert mesh.sent == []
        go.set()
        await step
        into[:] = -1  # the caller reuses its vector: what was kept is a copy
        await _settle(mesh)
        assert [(r, s, t, m) for r, s, t, _b, m in mesh.sent] == [
            (0, 7, tags.ROLL, {"have": True, "used": [0, 1, 2, 3], "late": []}),
            (0, 7, tags.ROLL + 1, None)]
        assert np.frombuffer(mesh.sent[1][3]).tolist() == [1, 2, 3, 4]

        async def fails() -> Any:
            ran.append(steps.take())
            raise PeerLost(3, "connection lost")

        await healer.step(steps, runs, into, rerun=False)  # step 8: nobody asks for 7 now
        with pytest.raises(PeerLost):  # step 9 fails here (rank 3 died)
            await healer.step(steps, fails, into, rerun=False, last=True)
        mesh.sent.clear()
        mesh.on_result_ask(0, ResultAsk(7))
        for _again in range(5):  # asked again before its answer left: the last one next
            mesh.on_result_ask(3, ResultAsk(9))
        await _settle(mesh)
        assert sorted((r, s, t, m) for r, s, t, _b, m in mesh.sent) == [
            (0, 7, tags.ROLL, {"have": False}), (3, 9, tags.ROLL, {"have": False}),
            (3, 9, tags.ROLL, {"have": False})]

    asyncio.run(body())


class ReachMesh(RollMesh):
    """Five ranks; this one is 1 and rank 2 died. Rank 0 is on the dead rank's host and not
    seen dead yet: dialled, it refuses. Rank 3's process is replaced while it is asked.
    Neither ever answers; rank 4 answers from the table."""

    def __init__(self, answers: dict[tuple[int, int, int], tuple[dict[str, Any], Any]]
                 ) -> None:
        super().__init__(answers)
        self.world_size = 5
        self.incarnations = Incarnations(1, 5)
        self.never: asyncio.Future[None] | None = None

    async def send_control(self, rank: int, event: object) -> None:
        from aioreduce.errors import PeerLost

        if rank == 0:
            raise PeerLost(0, "cannot connect: connection refused")
        self.controls.append((rank, event))

    def replaced(self, rank: int, incarnation: int) -> asyncio.Future[None]:
        fut = super().replaced(rank, incarnation)
        if rank == 3:  # its replacement rejoins while the ask waits
            asyncio.get_running_loop().call_soon(fut.set_result, None)
        return fut

    async def recv_into(self, rank: int, out: np.ndarray, *, step: int, tag: int = 0,
                        timeout: float | None = None) -> Any:
        if rank in (0, 3):
            self.never = asyncio.get_running_loop().create_future()
            await self.never  # (its timeout is a timer: the clock never moves here)
        return await super().recv_into(rank, out, step=step, tag=tag, timeout=timeout)


class Ring5:
    """A ring that re-forms (:class:`~aioreduce.schemes.base.Reforms`) over five ranks."""

    members = (0, 1, 2, 3, 4)

    def reform(self, members: Any, *, joined: bool = False) -> None:
        raise AssertionError("the step was taken, not run again")


def test_a_plain_ring_step_that_failed_here_is_taken_from_a_peer_that_finished_it() -> None:
    """Rank 1's plain ring step 5 (run again by itself) failed when rank 2 died; rank 4 had
    finished it: rank 1 takes rank 4's result and goes on (the step is not run again, the
    next one is step 6), and keeps it for a peer that asks in turn."""
    from aioreduce.errors import PeerLost
    from aioreduce.schemes import Result
    from aioreduce.stepper import Stepper
    from aioreduce.straggle import StraggleModel
    from aioreduce.wire.control import ResultAsk

    async def body(loop: clockloop.ClockLoop) -> None:
        total = np.arange(6, dtype=np.float64) * 5
        mesh = ReachMesh({(4, 5, tags.ROLL): ({"have": True, "used": [0, 1, 2, 3, 4],
                                               "late": []}, None),
                          (4, 5, tags.ROLL + 1): ({}, total)})
        healer = Healer(mesh, None, 5.0, lambda: [0, 2], rejoin_wait=5.0)  # type: ignore[arg-type]
        steps = Stepper(1, 5, StraggleModel(), None, None)
        steps.step = 5
        into = np.ones(6)
        ran: list[int] = []

        async def fails() -> Any:
            ran.append(steps.take())
            raise PeerLost(2, "connection lost")

        async def runs() -> Any:
            ran.append(steps.take())
            return Result(into, ran[-1], [0, 1, 3, 4])

        session: Any = Ring5()
        step = asyncio.ensure_future(healer.step(steps, fails, into, session=session))
        await clockloop.until(step.done)  # no timer needed: ranks 0 and 3 not waited for
        res = step.result()
        assert res.step == 5 and res.value is into and healer.rolled == 1
        assert np.array_equal(into, total)
        assert sorted(mesh.controls) == [(3, ResultAsk(5)), (4, ResultAsk(5))]
        await healer.step(steps, runs, into, session=session)
        assert ran == [5, 6]
        into[:] = -1  # the caller reuses its vector: what was kept (step 6) is a copy
        mesh.on_result_ask(4, ResultAsk(6))
        await _settle(mesh)
        assert [(r, s, t, m) for r, s, t, _b, m in mesh.sent] == [
            (4, 6, tags.ROLL, {"have": True, "used": [0, 1, 3, 4], "late": []}),
            (4, 6, tags.ROLL + 1, None)]
        assert np.frombuffer(mesh.sent[1][3]).tolist() == total.tolist()

    clockloop.run(body)


def test_asking_for_a_failed_steps_result_waits_for_no_peer_that_cannot_answer() -> None:
    """Nobody finished step 5: the ask ends once rank 4 says so, with no wait for rank 0 (the
    ask cannot reach it) or rank 3 (replaced meanwhile). Once it waited for their answers
    until its timeout: a lost host's second rank cost a spare-host restart a minute."""

    async def body(loop: clockloop.ClockLoop) -> None:
        mesh = ReachMesh({(4, 5, tags.ROLL): ({"have": False}, None)})
        healer = Healer(mesh, None, 5.0, lambda: [0, 2], rejoin_wait=5.0)  # type: ignore[arg-type]
        ask = asyncio.ensure_future(healer._roll_forward(5, np.ones(6), [2],
                                                         members=Ring5.members))
        await clockloop.until(ask.done)  # (the clock stands still: no timeout passed)
        assert ask.result() is None and mesh.never is not None and mesh.never.cancelled()

    clockloop.run(body)


def test_a_step_failed_for_ranks_is_run_again_only_for_ranks_known_dead() -> None:
    """Which ranks' deaths failed a step (the healer waits for their replacements and runs
    it again): every missing rank must be dead, by its broken connection, a newer
    incarnation, or a peer's word (``lost``). This process itself only by a peer's word:
    missing alone it was late (a tree's root cut it at its deadline), and running the step
    again alone would mix its vector into another step while its peers raise."""
    from aioreduce.schemes import StragglerError

    async def body() -> None:
        mesh = FakeMesh()
        mesh.broken.add(3)
        healer, _calls = _healer(mesh)
        known = [0, 0, 0, 0]
        dead = healer._dead
        assert dead(StragglerError(5, [3]), known) == [3]  # its connection broke here
        assert dead(StragglerError(5, [2]), known) == []  # late, as far as we know
        assert dead(StragglerError(5, [2], lost=[2]), known) == [2]  # a peer saw it die
        assert dead(StragglerError(5, [2, 3]), known) == []  # not every one dead
        assert dead(StragglerError(5, [1]), known) == []  # this process, only late
        assert dead(StragglerError(5, [1], lost=[1]), known) == [1]  # taken for its predecessor
        mesh.incarnations.known[2] = 1
        assert dead(StragglerError(5, [2]), known) == [2]  # replaced since the step began

    asyncio.run(body())


def test_a_steps_copy_of_its_vector_reuses_the_last_ones_memory() -> None:
    """With ``rejoin_wait`` a step summed in place first copies its vector (to restore it
    before a run again): into the memory of the last step's copy where it fits, a new array
    where it does not; one in use is not handed out twice."""
    healer, _calls = _healer(FakeMesh())
    a = np.arange(4.0)
    first = healer._save(a)
    assert first is not a and np.array_equal(first, a)
    healer._spare = first  # (the step ended: its copy is spare)
    again = healer._save(a * 2)
    assert again is first and np.array_equal(again, a * 2)
    assert healer._save(a) is not first  # taken: an overlapping step gets its own
    healer._spare = first
    assert healer._save(np.arange(5.0)) is not first  # another shape
