"""Rank-tagged output: every line a rank prints is prefixed with ``[rank] ``.

Output is read in chunks and split into lines here (not with ``readline``, which fails on very
long lines); bytes are decoded incrementally as UTF-8 with replacement, so a multi-byte
character split across reads is not mangled. The last lines of every rank are kept so the
launcher can show them when a rank fails.
"""

from __future__ import annotations

import codecs
import os
import sys
from collections import deque
from typing import BinaryIO

from .tracebacks import TracebackHold


class RankOutput:
    """Tags and writes one stream (stdout or stderr) of one rank."""

    def __init__(self, rank: int, stream: str, *, tag: bool = True,
                 out: BinaryIO | None = None, copy_to: str | None = None,
                 keep_lines: int = 20, append: bool = False) -> None:
        self.rank = rank
        self.stream = stream
        self.prefix = f"[{rank}] " if tag else ""
        self._out = out or (sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""
        self.last_lines: deque[str] = deque(maxlen=keep_lines)
        # stderr: a traceback is held back until the rank goes on or ends (see .tracebacks)
        self.held: TracebackHold | None = TracebackHold() if stream == "stderr" else None
        self._file: BinaryIO | None = None
        if copy_to is not None:
            os.makedirs(copy_to, exist_ok=True)
            # append: a restarted rank's process goes on in its predecessor's file
            self._file = open(os.path.join(copy_to, f"rank.{rank}.{stream}"),  # noqa: SIM115
                              "ab" if append else "wb")

    def feed(self, data: bytes) -> None:
        """Write every complete line in ``data`` (and what was pending), tagged."""
        if self._file is not None:
            self._file.write(data)
        text = self._partial + self._decoder.decode(data)
        *lines, self._partial = text.split("\n")
        self._emit(lines)

    def close(self) -> None:
        """Flush a last unterminated line and close the per-rank file."""
        rest = self._partial + self._decoder.decode(b"", final=True)
        self._partial = ""
        if rest:
            self._emit([rest])
        if self._file is not None:
            self._file.close()
            self._file = None

    def _emit(self, lines: list[str]) -> None:
        if not lines:
            return
        self.last_lines.extend(lines)
        if self.held is not None:
            lines = [out for line in lines for out in self.held.feed(line)]
        self._write(lines)

    def _write(self, lines: list[str]) -> None:
        if lines:
            self._out.write("".join(f"{self.prefix}{line}\n" for line in lines).encode())
            self._out.flush()

    def release(self) -> None:
        """Write a held traceback as it is (the summary will not say it)."""
        if self.held is not None:
            self._write(self.held.release())
