"""The launcher's failure policy, without processes: which deaths stop a job, who caused it.

A rank *dies* when it exits non-zero on its own (not because the launcher was stopping the
job). Up to ``tolerate`` deaths leave the job running, for schemes that finish without a few
ranks (coded tree, gradient coding, bounded-time); one more stops the job.

The *culprit* is the first death that is not a consequence of another: a rank whose last
output shows it died of :class:`~aioreduce.errors.PeerLost` (or a ``StragglerError`` naming lost
ranks) is a victim, since it only reports that some other rank went away. If every death is a
victim, the first one is named, with that caveat.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field

# The last line of a Python traceback of an exception that reports another rank's failure.
_VICTIM = re.compile(r"\b(PeerLost|StragglerError)\b")


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
        """Its output says it died because another rank was lost."""
        return any(_VICTIM.search(line) for line in self.last_lines[-3:])

    def describe(self) -> str:
        """E.g. ``rank 5 on localhost killed by SIGKILL``."""
        return f"rank {self.rank} on {self.host} {how_it_ended(self.code)}"


@dataclass
class FailurePolicy:
    """Counts deaths against the tolerance and decides the launcher's exit status."""

    tolerate: int = 0
    deaths: list[Death] = field(default_factory=list)
    stopped: bool = False  # the job is being stopped: later exits are not deaths

    def exited(self, rank: int, host: str, code: int, last_lines: Sequence[str]) -> bool:
        """Record an exit; True if the job must now be stopped."""
        if code == 0 or self.stopped:
            return False
        self.deaths.append(Death(rank, host, code, tuple(last_lines)))
        if len(self.deaths) > self.tolerate:
            self.stopped = True
        return self.stopped

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
        if self.stopped and self.culprit is not None:
            return self.culprit.code
        if interrupted is not None:
            return 128 + interrupted
        return 0

    def summary(self) -> list[str]:
        """Lines for the end of the job: every death, then the culprit with its last lines."""
        if not self.deaths:
            return []
        verdict = ("the job was stopped" if self.stopped
                   else f"tolerated ({len(self.deaths)} of at most {self.tolerate}); "
                        "the others finished")
        lines = [f"{len(self.deaths)} rank(s) died, {verdict}:"]
        lines += [f"  {d.describe()}" + (" (after another rank was lost)" if d.victim else "")
                  for d in self.deaths]
        culprit = self.culprit
        if self.stopped and culprit is not None:
            why = (" (every death reports a lost peer; the first is named)"
                   if culprit.victim else "")
            tail = culprit.last_lines[-10:]
            lines.append(f"culprit: {culprit.describe()}{why}"
                         + ("; its last lines:" if tail else "; it printed nothing"))
            lines += [f"  [{culprit.rank}] {line}" for line in tail]
        return lines
