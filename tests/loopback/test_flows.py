"""A background flow's source and sink as the emulated cluster runs them (``python -m
aioreduce.bench.flows``), over 127.0.0.1: every byte sent in bursts is received."""

from __future__ import annotations

import subprocess
import sys

from aioreduce.bench.flows import CHUNK

FLOWS = [sys.executable, "-m", "aioreduce.bench.flows"]


def _flow(*source_args: str) -> tuple[list[int], int]:
    sink = subprocess.Popen([*FLOWS, "sink", "127.0.0.1", "0"], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert sink.stdout is not None
        first = sink.stdout.readline()
        assert first.startswith("ready "), first
        port = first.split()[1]
        src = subprocess.run([*FLOWS, "source", "127.0.0.1", port, *source_args],
                             capture_output=True, text=True, timeout=60)
        assert src.returncode == 0, src.stderr
        received = sink.communicate(timeout=60)[0]
    finally:
        sink.kill()
        sink.wait()
    sent = [int(x) for x in src.stdout.split()[1:]]
    assert received.startswith("received "), received
    return sent, int(received.split()[1])


def test_bursts_send_what_the_sink_receives() -> None:
    sent, received = _flow("--on", "0.002", "--off", "0.002", "--seed", "1", "--bursts", "3")
    assert len(sent) == 3 and all(n >= CHUNK and n % CHUNK == 0 for n in sent), sent
    assert received == sum(sent)


def test_a_steady_flow_with_a_limit_sends_that_many_chunks() -> None:
    sent, received = _flow("--bursts", "4")
    assert sent == [4 * CHUNK] and received == 4 * CHUNK
