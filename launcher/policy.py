"""The launcher's failure policy, without processes: which deaths stop a job, who caused it.

A rank *dies* when it exits non-zero on its own (not because the launcher was stopping the
job). Up to ``restart`` deaths are answered with a new process for that rank, which rejoins
the running job and heals from a live peer (see :mod:`aioreduce.heal`); past those, up to
``tolerate`` deaths leave the job running, for schemes that finish without a few ranks (coded
tree, gradient coding, bounded-time); one more stops the job.

The *culprit* is the first death that is not a consequence of another: a rank whose last
output shows it died of :class:`~aioreduce.errors.PeerLost` (or a ``StragglerError`` naming
lost ranks; an abort forwarded by a ring neighbour is one too) is a victim, since it only
reports that some other rank went away. A victim often exits before the rank that caused it
(its peer's connection closes as that rank raises), so while every death so far is a victim
the launcher waits a bounded moment (:attr:`FailurePolicy.waiting_for_cause`) before it stops
the job; if every death is still a victim, the first one is named, with that caveat.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field

from .tracebacks import rank_ranges, same_error

# A traceback's exception line ("module.Name: message", at the start of a line), and those
# of the exceptions that report another rank's failure.
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Lost|Interrupt|Exit|Warning)\b.*")
_VICTIM = re.compile(r"^[\w.]*\b(PeerLost|StragglerError)\b")


def how_it_ended(code: int) -> str:
    """``"killed by SIGKILL"`` for shell code 137, ``"exited with code 3"`` otherwise."""
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exited with code {code}"


@dataclass(frozen=True)
class Death:
    """A rank that exited non-zero on its own."""

    rank: int
    host: str
    code: int
    last_lines: tuple[str, ...]

    @property
    def victim(self) -> bool:
        """Its output says it died because another rank was lost: an exception line of
        ``PeerLost``/``StragglerError`` among its last lines (teardown noise after it, such as
        a task destroyed at exit, does not hide it)."""
        return any(_VICTIM.match(line) for line in self.last_lines)

    def describe(self) -> str:
        """E.g. ``rank 5 on localhost killed by SIGKILL``."""
        return f"rank {self.rank} on {self.host} {how_it_ended(self.code)}"

    @property
    def error(self) -> str:
        """What it died of, at most 200 characters: a victim's lost-peer exception line,
        else its last exception line, else its last non-blank line."""
        lines = list(reversed(self.last_lines))
        line = (next((x for x in lines if _VICTIM.match(x)), "")
                or next((x for x in lines if _EXCEPTION.match(x)), "")
                or next((x for x in lines if x.strip()), ""))
        return line[:200]


@dataclass
class FailurePolicy:
    """Counts deaths against the tolerance and decides the launcher's exit status."""

    tolerate: int = 0
    deaths: list[Death] = field(default_factory=list)
    stopped: bool = False  # the launcher is stopping the job: later exits are not deaths
    restart: int = 0  # deaths answered with a new process, in all
    restarted: list[Death] = field(default_factory=list)
    # Rank 0 exited 0: the job is over. A replacement that is still on its way (it has no
    # live rank left to heal from) is late, not dead; nothing is restarted any more.
    finished: bool = False
    late: list[int] = field(default_factory=list)

    def restarts(self, rank: int, host: str, code: int, last_lines: Sequence[str]) -> bool:
        """Record an exit as a death to restart, if it is one and restarts are left."""
        if (code == 0 or self.stopped or self.finished
                or len(self.restarted) >= self.restart):
            return False
        self.restarted.append(Death(rank, host, code, tuple(last_lines)))
        return True

    def exited(self, rank: int, host: str, code: int, last_lines: Sequence[str]) -> bool:
        """Record an exit; True if the deaths are now beyond the tolerance (the job must
        stop: the caller calls :meth:`stop`, at once or after waiting for a cause)."""
        if code == 0 or self.stopped:
            return False
        if self.finished and self.replaced(rank):
            self.late.append(rank)
            return False
        self.deaths.append(Death(rank, host, code, tuple(last_lines)))
        return self.failed

    def replaced(self, rank: int) -> bool:
        """Whether ``rank`` runs a replacement process."""
        return any(d.rank == rank for d in self.restarted)

    def stop(self) -> None:
        """The launcher terminates the job from now on: exits are no longer deaths."""
        self.stopped = True

    @property
    def failed(self) -> bool:
        """More deaths than tolerated."""
        return len(self.deaths) > self.tolerate

    @property
    def waiting_for_cause(self) -> bool:
        """The job must stop, but every death so far reports a lost peer: the rank that
        caused them may still be on its way out."""
        return self.failed and all(d.victim for d in self.deaths)

    @property
    def culprit(self) -> Death | None:
        """The first death that is not a victim of another (else the first death)."""
        for d in self.deaths:
            if not d.victim:
                return d
        return self.deaths[0] if self.deaths else None

    def exit_code(self, interrupted: int | None) -> int:
        """The culprit's code if deaths stopped the job; 128+signal if interrupted; else 0.

        Tolerated deaths alone give 0: the job finished as asked.
        """
        if self.failed and self.culprit is not None:
            return self.culprit.code
        if interrupted is not None:
            return 128 + interrupted
        return 0

    def summary(self) -> list[str]:
        """Lines for the end of the job: every restart, every death, then the culprit with
        its last lines."""
        lines = [f"{d.describe()}; restarted ({i} of at most {self.restart})"
                 + (f": {d.error}" if d.error and d.code != 137 else "")
                 for i, d in enumerate(self.restarted, 1)]
        lines += [f"rank {rank}'s replacement came after the job had finished (rank 0 exited "
                  "0): stopped, not counted as a death" for rank in self.late]
        if not self.deaths:
            return lines
        verdict = ("the job was stopped" if self.failed
                   else f"tolerated ({len(self.deaths)} of at most {self.tolerate}); "
                        "the others finished")
        lines.append(f"{len(self.deaths)} rank(s) died, {verdict}:")
        # Ranks that ended the same way with the same error are one line.
        groups: dict[tuple[str, int, str], list[Death]] = {}
        for d in self.deaths:
            groups.setdefault((d.host, d.code, same_error(d.error, d.rank)), []).append(d)
        for (host, code, _), same in groups.items():
            first = same[0]
            who = (first.describe() if len(same) == 1 else
                   f"ranks {rank_ranges([d.rank for d in same])} on {host} "
                   f"{how_it_ended(code)}")
            lines.append(f"  {who}" + (" (after another rank was lost)" if first.victim else "")
                         + (f": {first.error}" if first.error else ""))
        culprit = self.culprit
        if self.failed and culprit is not None:
            why = (" (every death reports a lost peer; the first is named)"
                   if culprit.victim else "")
            tail = culprit.last_lines[-10:]
            lines.append(f"culprit: {culprit.describe()}{why}"
                         + ("; its last lines:" if tail else "; it printed nothing"))
            lines += [f"  [{culprit.rank}] {line}" for line in tail]
        return lines
