"""Short straggler-model soaks (the long ones: ``python -m tests.loopback.straggle_soak``): each
injected model once, each scheme at least once, every result checked on every rank."""

from __future__ import annotations

import pytest

from .straggle_soak import MODELS, SETUPS, soak

pytestmark = pytest.mark.loopback

PAIRS = [
    ("coded-tree", "spike"),
    ("coded-tree", "load-exp"),  # a delay per unit of coded load
    ("gc-cyclic", "shifted-exp"),
    ("gc-cyclic", "delay"),
    ("transpose", "pause"),
    ("ring", "shifted-exp"),
    ("tree", "slow"),
    ("star", "spike"),
]


def test_every_model_and_scheme_is_soaked() -> None:
    assert {m for _s, m in PAIRS} == set(MODELS)
    assert {s for s, _m in PAIRS} == set(SETUPS)


@pytest.mark.parametrize(("scheme", "model"), PAIRS, ids=[f"{s}-{m}" for s, m in PAIRS])
def test_straggle_soak(scheme: str, model: str) -> None:
    run = soak(scheme, model, steps=30, timeout=240)
    assert run.ok, "\n".join(run.problems[:20])
    if SETUPS[scheme].kind != "waits":  # (checked in the run too: the model bit)
        assert run.figures["left a delayed rank out"], run.figures
