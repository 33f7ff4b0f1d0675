"""Step telemetry: one JSON line per rank per step (:mod:`.record`), and a tool that turns a
job's traces into a summary table and a timeline PNG (:mod:`.report`, ``aioreduce-trace``).

Turn it on with ``AIOREDUCE_TRACE=DIR`` (every rank writes ``DIR/rank.N.jsonl``) or
``Node(..., trace=DIR)``.
"""

from .record import StepRecord, Tracer, TracingComm, trace_path

__all__ = ["StepRecord", "Tracer", "TracingComm", "trace_path"]
