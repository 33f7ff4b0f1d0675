"""The reduce-broadcast engine behind CodedTree, GradientCoding, Tree and Star.

One concept per module: :mod:`.family` (a rank's place, frame tags), :mod:`.report` (typed
reports and verdicts), :mod:`.gather` (sufficiency and decoding), :mod:`.history` (the window
of recent outcomes), :mod:`.failover` (where results come from: an explicit state machine),
:mod:`.paths` (the up and down halves of a step) and :mod:`.session` (the state kept across
steps, serving requests, forwarding).
"""

from .failover import Ask, Link, ParentFailover
from .family import DOWN, REQUEST_TAG, VERDICT_TAG, Family
from .history import Outcome, ResultLog
from .report import Report, Verdict
from .session import ReduceSession

__all__ = ["DOWN", "REQUEST_TAG", "VERDICT_TAG", "Ask", "Family", "Link", "Outcome",
           "ParentFailover", "ReduceSession", "Report", "ResultLog", "Verdict"]
