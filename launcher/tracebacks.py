"""Python tracebacks held back from a rank's live output, so that one error is said once.

When every rank of a job fails the same way (a wrong ``-n``, the same bad argument) each one
prints the same traceback; interleaved, 13 of them bury the one line that matters. So the
launcher holds a rank's traceback back from its live stderr: if the rank goes on printing
after it (it caught and logged the error), the traceback is written then, as it was; if the
rank ends, the supervisor's summary says each distinct error once, with the ranks that
printed it and the culprit's last lines (``--output-dir`` keeps every line of every rank).
"""

from __future__ import annotations

import re

HEADER = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class TracebackHold:
    """A line filter for one rank's stderr: lines pass, a traceback is held.

    A traceback starts at its header and ends at its exception line (the first line after it
    that is not indented, blank or a chaining remark); chained tracebacks extend it. A held
    traceback followed by any other line is released ahead of that line."""

    def __init__(self) -> None:
        self.block: list[str] = []
        self._ended = False  # the exception line has been seen

    def feed(self, line: str) -> list[str]:
        """The lines to write now for ``line`` (none while a traceback is held)."""
        if not self.block:
            if line == HEADER:
                self.block, self._ended = [line], False
                return []
            return [line]
        if not self._ended:
            self.block.append(line)
            if line and not line[0].isspace() and line != HEADER \
                    and not line.startswith(CHAINED):
                self._ended = True
            return []
        if line == "" or line.startswith(CHAINED) or line == HEADER:
            self.block.append(line)  # a chained traceback follows
            if line:
                self._ended = False
            return []
        out = [*self.release(), line]  # the rank went on: it was not fatal
        return out

    def release(self) -> list[str]:
        """The held lines, no longer held."""
        out, self.block = self.block, []
        return out

    @property
    def ended(self) -> bool:
        """The held traceback has reached its exception line (it was not cut short)."""
        return bool(self.block) and self._ended

    def generic(self, rank: int) -> list[str]:
        """The held lines with ``rank``'s own number made generic (:func:`same_error`), to
        compare one rank's traceback with another's."""
        return [same_error(line, rank) for line in self.block]

    @property
    def error(self) -> str:
        """The held traceback's last non-blank line (its exception), or ''."""
        return next((line for line in reversed(self.block) if line.strip()), "")


def same_error(line: str, rank: int) -> str:
    """``line`` with the rank's own number made generic, so ranks that say the same thing
    about themselves ("rank 3: ...", "rank 4: ...") count as one error."""
    return re.sub(rf"\brank {rank}\b", "rank *", line)


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2,5,7-8``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
