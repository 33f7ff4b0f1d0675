"""Rendezvous through rank 0, and a barrier, over the mesh's control messages.

Rank 0 listens on the rendezvous port. Every other rank dials it (retrying while rank 0 is not
up yet), opens its own listener on the address its route to rank 0 uses (or on the configured
one), and registers (rank, host, port). When everyone has registered, rank 0 sends the address
table to all. A rank that never registers makes rank 0 fail with an error naming the missing
ranks, and the others fail because rank 0 closes their connections.

While the job runs, rank 0 keeps serving registrations: a process that replaces a dead rank
(restarted: same rank, maybe another host and port) registers like any rank and gets the table
with its incarnation (see :mod:`aioreduce.wire.incarnation`), and rank 0 tells every other
rank where it listens now (:class:`~aioreduce.wire.control.Moved`).

Rank 0 can be replaced too, at the same address (the one every rank was given: a launcher
restarts it on its host). Every other rank, once rank 0's process is gone, dials that address
until a new one listens there; a rank-0 process that dialing finds still without an
incarnation hears from the first live rank that reaches it that the job runs
(:class:`~aioreduce.wire.control.Running`: the table as that rank knows it), instead of
waiting for registrations. It takes rank 0's next incarnation, tells every rank
(:class:`~aioreduce.wire.control.Moved`), admits the replacements of other ranks that
registered meanwhile, and serves registrations from then on; its node heals like any
replacement (:mod:`aioreduce.heal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from ..errors import AuthError, PeerLost, RendezvousError
from ..wire.control import (
    CLOSING_BARRIER,
    Abort,
    Arrive,
    Control,
    MalformedControl,
    Moved,
    Register,
    Release,
    Running,
    Table,
)
from ..wire.incarnation import JOINING
from .mesh import Mesh

log = logging.getLogger("aioreduce.transport")

ABORT_GRACE_S = 2.0
MISSING_HINT = ("check that they were started, with the same world size, AIOREDUCE_MASTER_ADDR/"
                "PORT (or MASTER_ADDR/PORT), secret and job id, and that they can reach rank 0")
SETTLE_S = 1.0  # at most this long for handshakes in flight when everyone has registered


async def _gather_from(mesh: Mesh, ranks: list[int], want: type[Control], deadline: float,
                       excused: dict[int, str] | None = None,
                       recv: Callable[[int], Awaitable[Control]] | None = None,
                       stop: asyncio.Future[Running] | None = None) -> dict[int, Control]:
    """Receive one control event of type ``want`` (or an :class:`Abort`) from each of
    ``ranks`` before ``deadline`` (through ``recv``, by default the mesh's next one); ranks
    that land in ``excused`` meanwhile (started for another job) are not waited for. Once
    ``stop`` is done, return what came so far."""
    op = want.op
    loop = asyncio.get_running_loop()
    tasks = {r: asyncio.ensure_future((recv or mesh.recv_control)(r)) for r in ranks}
    # One future a round, resolved by whatever can change the answer: a receive that ends,
    # ``stop``, the deadline, or (where ranks can be excused) a misconfiguration. Waiting on
    # every pending receive each round (asyncio.wait) cost rank 0 of a 13-rank barrier
    # O(ranks^2) callbacks and a task a round.
    changed: asyncio.Future[None] = loop.create_future()

    def poke(_: object = None) -> None:
        if not changed.done():
            changed.set_result(None)

    for t in tasks.values():
        t.add_done_callback(poke)
    if stop is not None:
        stop.add_done_callback(poke)
    # (Only a misconfiguration can excuse a rank: without ``excused`` it changes nothing.)
    wake = (asyncio.ensure_future(mesh.misconfigured.wait())
            if excused is not None and not mesh.misconfigured.is_set() else None)
    if wake is not None:
        wake.add_done_callback(poke)
    excused = {} if excused is None else excused
    try:
        while True:
            if stop is not None and stop.done():
                return {r: t.result() for r, t in tasks.items()
                        if t.done() and not t.cancelled() and t.exception() is None}
            if not any(not t.done() and r not in excused for r, t in tasks.items()):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            changed = loop.create_future()
            timer = loop.call_later(left, poke)
            try:
                await changed
            finally:
                timer.cancel()
        tasks = {r: t for r, t in tasks.items() if r not in excused or t.done()}
        malformed = sorted(r for r, t in tasks.items() if t.done() and not t.cancelled()
                           and isinstance(t.exception(), MalformedControl))
        if malformed:
            raise RendezvousError(f"ranks {malformed} sent a malformed control message during "
                                  f"{op}: {tasks[malformed[0]].exception()}")
        missing = sorted(r for r, t in tasks.items() if not t.done() or t.exception())
        if missing:
            hint = f": {MISSING_HINT}" if op == "register" else ""
            raise RendezvousError(f"rank {mesh.rank}: ranks {missing} did not reach {op} "
                                  f"in time{hint}", missing=missing)
        out = {r: t.result() for r, t in tasks.items()}
        wrong = sorted(r for r, m in out.items() if not isinstance(m, want | Abort))
        if wrong:
            raise RendezvousError(f"ranks {wrong} sent the wrong control message during {op}")
        return out
    finally:
        if stop is not None:
            stop.remove_done_callback(poke)
        if wake is not None:
            wake.cancel()
        for t in tasks.values():
            t.cancel()


async def rendezvous(mesh: Mesh, master: tuple[str, int], *, advertise: str | None,
                     bind: str | None, timeout: float) -> None:
    """Fill ``mesh.addresses`` for every rank. Rank 0 must already listen on ``master``, with
    no incarnation yet (``JOINING``, set before it listens: the process may replace a dead
    rank 0, and handshakes begin as soon as it listens)."""
    deadline = time.monotonic() + timeout
    if mesh.rank == 0:
        mesh.addresses[0] = (advertise or master[0], master[1])
        others = list(range(1, mesh.world_size))
        # No incarnation until a live rank says the job runs, or the job starts (0).
        assert mesh.incarnations.mine == JOINING, "rank 0 listens as JOINING (Node.start)"
        running: asyncio.Future[Running] = asyncio.get_running_loop().create_future()

        def told(_rank: int, event: Running) -> None:
            if not running.done():
                running.set_result(event)

        mesh.on_running = told
        try:
            regs = await _gather_from(mesh, others, Register, deadline,
                                      excused=mesh.wrong_jobs, stop=running)
        except RendezvousError as exc:
            # Tell the ranks that did come which ones are missing, so every log names them.
            await _abort(mesh, [r for r in others if r not in exc.missing], str(exc),
                         exc.missing)
            raise
        finally:
            mesh.on_running = None
        if running.done():
            await _resume(mesh, running.result(), regs, timeout)
            return
        await mesh.handshakes_settled(SETTLE_S)  # a second process for a rank may be mid-way
        problem = _check_registrations(mesh, regs)
        if problem:
            await _abort(mesh, others, problem, [])
            raise RendezvousError(f"rank 0: {problem}")
        mesh.hosts = count_hosts(host for host, _ in mesh.addresses.values())
        table = _table(mesh)
        mesh.incarnations.mine = 0
        await asyncio.gather(*(mesh.send_control(r, table) for r in others))
        mesh.incarnations.running = True
        mesh.on_joining = lambda r: mesh.spawn(_serve_rejoin(mesh, r, timeout))
        return

    delay = 0.02
    mesh.incarnations.mine = JOINING  # rank 0's table gives this process its number
    while True:
        try:
            conn = await mesh.connect(0, master)
            break
        except AuthError:
            raise
        except PeerLost as exc:
            if time.monotonic() + delay > deadline:
                raise RendezvousError(f"rank {mesh.rank}: cannot reach rank 0 at "
                                      f"{master[0]}:{master[1]} within {timeout} s: {exc.reason} "
                                      "(check that rank 0 runs there and that "
                                      "AIOREDUCE_MASTER_ADDR/PORT, or MASTER_ADDR/PORT, name "
                                      "it)",
                                      missing=[0]) from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
    assert conn.transport is not None
    # Our address as rank 0 sees it; over a Unix socket rank 0 is on this host, so its own
    # address is one of ours.
    local = master[0] if conn.local else conn.transport.get_extra_info("sockname")[0]
    host, port = await mesh.listen(bind or advertise or local, 0)
    await mesh.send_control(0, Register(advertise or host, port, mesh.world_size))
    # Rank 0 gives up at the same deadline and then says who is missing: allow for that.
    try:
        msg = (await _gather_from(mesh, [0], Table, deadline + ABORT_GRACE_S))[0]
    except RendezvousError:
        raise RendezvousError(f"rank {mesh.rank}: rank 0 sent no address table within "
                              f"{timeout} s (rank 0 is alive but waited for other ranks or for "
                              "this one: check its log)", missing=[0]) from None
    if isinstance(msg, Abort):
        if msg.missing:
            raise RendezvousError(f"rank {mesh.rank}: ranks {list(msg.missing)} never joined "
                                  f"the job: {MISSING_HINT}", missing=list(msg.missing))
        raise RendezvousError(f"rank {mesh.rank}: rank 0 stopped the job: {msg.reason}")
    assert isinstance(msg, Table)
    if len(msg.addresses) != mesh.world_size or len(msg.incarnations) not in (
            0, mesh.world_size):
        raise RendezvousError("rank 0 sent a malformed address table")
    for r, address in enumerate(msg.addresses):
        mesh.addresses[r] = address
    mesh.hosts = msg.hosts or count_hosts(host for host, _ in msg.addresses)
    mesh.incarnations.learn(msg.incarnations or (0,) * mesh.world_size)
    if mesh.incarnations.rejoined:
        log.warning("rank %d rejoined the running job as incarnation %d", mesh.rank,
                    mesh.incarnations.mine)
    # Rank 0's process may die and be replaced at its address: dial it until one listens
    # there, and tell one that has no incarnation yet that the job runs.
    mesh.on_rank0_joining = lambda: mesh.spawn(_tell_running(mesh))
    redialing: list[bool] = [False]

    def lost(rank: int) -> None:
        if rank == 0 and not mesh.leaving and not redialing[0]:
            redialing[0] = True
            mesh.spawn(_redial_rank0(mesh, redialing, timeout))

    mesh.on_peer_lost(lost)


async def _redial_rank0(mesh: Mesh, redialing: list[bool], timeout: float) -> None:
    """Rank 0's last connection broke: dial its address until a new process listens there,
    the job ends, or ``timeout`` (the rendezvous's) passed: a process of this job left
    dialing a port that a later job's rank 0 may take would be named in that job's log
    (:func:`_tell_running` follows a dial that reaches one without an incarnation)."""
    delay, give_up = 0.02, time.monotonic() + timeout
    try:
        while time.monotonic() < give_up:
            # First a pause: a dial at once reaches the dying process's listener.
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            if not mesh.is_lost(0) or mesh.leaving:
                return
            with contextlib.suppress(PeerLost, AuthError):  # nobody there yet, or not ours
                await mesh.connect(0)
                return
        log.warning("rank %d: rank 0 did not come back within %g s; not dialing it any more",
                    mesh.rank, timeout)
    finally:
        redialing[0] = False


async def _tell_running(mesh: Mesh) -> None:
    """A rank-0 process without an incarnation took our dial: it replaces a dead rank 0;
    tell it the job runs, with the table as this rank knows it."""
    table = _table(mesh, tuple(mesh.incarnations.known))
    try:
        await mesh.send_control(0, Running(table.addresses, table.incarnations, table.hosts))
    except PeerLost as exc:  # it went away again: the next one is dialed anew
        log.warning("rank %d: could not tell rank 0's new process that the job runs: %s",
                    mesh.rank, exc)


async def _resume(mesh: Mesh, running: Running, regs: dict[int, Control],
                  timeout: float) -> None:
    """Rank 0: this process replaces a dead rank 0 of a running job (``running`` from a live
    rank). Take the job's table and rank 0's next incarnation, tell every rank, admit the
    replacements of other ranks that registered meanwhile (``regs``), and serve the next."""
    if len(running.addresses) != mesh.world_size:
        raise RendezvousError(f"rank 0: a live rank sent a table of {len(running.addresses)} "
                              f"ranks; this job has {mesh.world_size}: check WORLD_SIZE / -n")
    home = mesh.addresses[0]
    mesh.addresses.update(enumerate(running.addresses))
    mesh.addresses[0] = home
    mesh.hosts = running.hosts or count_hosts(host for host, _ in mesh.addresses.values())
    mesh.incarnations.resume(running.incarnations)
    mesh.on_joining = lambda r: mesh.spawn(_serve_rejoin(mesh, r, timeout))
    log.warning("rank 0 rejoined the running job as incarnation %d", mesh.incarnations.mine)
    joined = {r: m for r, m in regs.items() if isinstance(m, Register)}
    # Replacements that reached us before that word but whose registration did not come
    # first (it may still be on the way): served like any rejoin, from their registration.
    late = sorted(mesh.joined_early - set(joined) - {0})
    for r in [*joined, *late]:  # they registered as if the job started: replacements too
        mesh.incarnations.known[r] += 1
    if joined or late:
        log.warning("rank 0: ranks %s registered before a live rank said the job runs: "
                    "replacements too", sorted([*joined, *late]))
    moved = Moved(0, home[0], home[1], mesh.incarnations.mine)
    # The ranks that reached us hear it first, before anything else we send them (a heal
    # request of an incarnation they did not know would be ignored); the others are dialed
    # in the background (a dead one's dial may take its timeout), and learn it from that
    # dial's handshake.
    tell = [r for r in range(1, mesh.world_size) if r not in joined and r not in late]
    near = [r for r in tell if mesh.connected(r)]
    await asyncio.gather(*(mesh.send_control(r, moved) for r in near), return_exceptions=True)

    async def tell_the_others() -> None:
        await asyncio.gather(*(mesh.send_control(r, moved) for r in tell if r not in near),
                             return_exceptions=True)

    mesh.spawn(tell_the_others())
    for r, msg in joined.items():
        mesh.spawn(_admit(mesh, r, msg))
    for r in late:
        mesh.spawn(_serve_rejoin(mesh, r, timeout))


async def _serve_rejoin(mesh: Mesh, rank: int, timeout: float) -> None:
    """Rank 0: a process replacing ``rank`` connected to the running job; take its
    registration, send it the table (with its incarnation), and tell every other rank."""
    try:
        msg = await mesh.recv_control(rank, timeout)
    except Exception as exc:  # it went away again: the next one will register
        log.warning("rank 0: the replacement of rank %d did not register: %s", rank, exc)
        return
    await _admit(mesh, rank, msg)


async def _admit(mesh: Mesh, rank: int, msg: Control) -> None:
    """Rank 0: ``msg`` from the replacement of ``rank`` (whose incarnation is known): send it
    the table and tell every other rank where it listens."""
    if not isinstance(msg, Register) or msg.world != mesh.world_size:
        log.error("rank 0: the replacement of rank %d sent %s; expected a registration with "
                  "world size %d", rank, msg, mesh.world_size)
        return
    mesh.set_address(rank, (msg.host, msg.port))
    await mesh.send_control(rank, _table(mesh, tuple(mesh.incarnations.known)))
    inc = mesh.incarnations.known[rank]
    moved = Moved(rank, msg.host, msg.port, inc)
    log.warning("rank 0: rank %d rejoined as incarnation %d at %s:%d", rank, inc, msg.host,
                msg.port)
    await asyncio.gather(*(mesh.send_control(r, moved) for r in range(1, mesh.world_size)
                           if r != rank), return_exceptions=True)


def count_hosts(hosts: Iterable[str]) -> int:
    """How many hosts the ranks' addresses name: as written, but ``localhost``, ``::1`` and
    ``127.0.0.1`` count as one (rank 0 may be named ``localhost`` while the others see
    ``127.0.0.1``). No name is resolved, and other loopback addresses stay apart (tests use
    127.0.0.2 as a second host): a host named two ways counts twice, and the trees then cut
    finer chunks than one host needs (every rank still cuts alike)."""
    return len({"127.0.0.1" if h in _LOOPBACK else h for h in hosts})


_LOOPBACK = frozenset({"localhost", "::1", "127.0.0.1"})


def _table(mesh: Mesh, incarnations: tuple[int, ...] = ()) -> Table:
    """Rank 0's address table as it stands (with every rank's incarnation, for a rejoin)."""
    return Table(tuple(mesh.addresses[r] for r in range(mesh.world_size)), incarnations,
                 mesh.hosts)


def _check_registrations(mesh: Mesh, regs: dict[int, Control]) -> str:
    """What is wrong with the job as registered ("" if nothing), saying what to check."""
    for r, job in sorted(mesh.wrong_jobs.items()):
        if r not in regs:
            return (f"rank {r} was started for job {job!r}, this job is {mesh.job!r}: check "
                    "AIOREDUCE_JOB (the job id) on every host")
    if mesh.duplicates:
        r, where = next(iter(sorted(mesh.duplicates.items())))
        return (f"rank {r} was started twice (from {' and '.join(where)}): check the launch, "
                "every rank must be started exactly once")
    for r, msg in sorted(regs.items()):
        if not isinstance(msg, Register):
            return f"rank {r} sent {type(msg).__name__} instead of registering"
        if msg.world != mesh.world_size:
            return (f"rank {r} believes the world size is {msg.world}, rank 0 believes "
                    f"{mesh.world_size}: check WORLD_SIZE / -n on every host")
        mesh.addresses[r] = (msg.host, msg.port)
    return ""


async def _abort(mesh: Mesh, ranks: list[int], reason: str, missing: list[int]) -> None:
    """Tell ``ranks`` why the job will not start, so every rank's log names the cause."""
    await asyncio.gather(*(mesh.send_control(r, Abort(reason, tuple(missing))) for r in ranks),
                         return_exceptions=True)  # each send returns once in the kernel


async def barrier(mesh: Mesh, timeout: float, *, closing: bool = False) -> None:
    """Wait until every rank has reached the barrier (gathered at and released by rank 0).

    Ranks that do not come within ``timeout``: rank 0 tells the ones that came, and every
    rank there raises :class:`RendezvousError` naming the missing ranks (torch's
    ``monitored_barrier`` has only rank 0 name them).

    ``closing``: the job ends here. Rank 0 stops listening before it releases anyone, so a
    rank that goes on to join a next job on the same port cannot reach this job's listener
    while it shuts down (it would be dropped mid-handshake).
    """
    deadline = time.monotonic() + timeout
    if mesh.world_size == 1:
        return
    if closing:
        mesh.leaving = True  # a rank 0 that dies now is not dialed anew
        n = CLOSING_BARRIER  # not counted: a rank that missed a caller's barrier closes too
    else:
        n = mesh.barriers
        mesh.barriers += 1

    async def this_barrier(rank: int) -> Control:
        """The next control event from ``rank`` that is not of an earlier barrier (a late
        arrival there, or an answer to one that came after we gave up)."""
        while True:
            msg = await mesh.recv_control(rank)
            if not isinstance(msg, Arrive | Release | Abort) or msg.barrier >= n:
                return msg
            log.debug("rank %d: dropped a late %s of barrier %d (now at %d) from rank %d",
                      mesh.rank, msg.op, msg.barrier, n, rank)

    if mesh.rank == 0:
        # The job's last barrier does not wait for a rank whose process is gone (its
        # connection broke and no replacement came): the ranks that finished without it (a
        # ring re-formed over them, a coded tree's sums) end without it too.
        others = [r for r in range(1, mesh.world_size) if not (closing and mesh.is_lost(r))]
        try:
            got = await _gather_from(mesh, others, Arrive, deadline, recv=this_barrier)
            missing: list[int] = sorted(r for r, m in got.items() if isinstance(m, Arrive)
                                        and m.barrier != n)
            why = (f"ranks {missing} called a later barrier than rank 0 (its barrier {n + 1}):"
                   " every rank must call every barrier" if missing else "")
        except RendezvousError as exc:  # release the ranks that came anyway, then report
            missing = exc.missing
            why = (f"ranks {missing} did not reach the barrier within {timeout:g} s"
                   if missing else str(exc))
        if closing:
            mesh.stop_listening()
        answer: Release | Abort = Abort(why, tuple(missing), n) if why else Release(n)
        await asyncio.gather(*(mesh.send_control(r, answer)
                               for r in others if r not in missing), return_exceptions=True)
        if why:
            raise RendezvousError(f"rank 0: {why}", missing=missing)
        return
    if closing and mesh.is_lost(0):
        return  # rank 0 is gone (the ring went on without it): nobody gathers this barrier
    await mesh.send_control(0, Arrive(n))
    # Rank 0 gives up at the same deadline and then says who is missing: allow for that.
    msg = (await _gather_from(mesh, [0], Release, deadline + ABORT_GRACE_S,
                              recv=this_barrier))[0]
    if isinstance(msg, Abort):
        raise RendezvousError(f"rank {mesh.rank}: {msg.reason} (rank 0 waited for them)",
                              missing=list(msg.missing))
