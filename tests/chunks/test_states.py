"""Tensor-state whitelist and derived chunk predicates."""

from __future__ import annotations

import pytest

from infinity.chunks.states import IllegalTransition, StateCounters
from infinity.chunks.states import TensorState as S


def test_counters_follow_transitions():
    c = StateCounters(3)
    assert c.count(S.FREE) == 3
    for i in range(3):
        c.set(i, S.HOLD)
    c.set(0, S.COMPUTE)
    assert c.in_compute and c.count(S.HOLD) == 2
    c.set(0, S.HOLD_AFTER_FWD)
    c.set(0, S.HOLD_AFTER_BWD)
    assert not c.in_compute
    assert sum(c.counts) == 3
    c.reset_step()
    assert c.count(S.HOLD) == 3


def test_illegal_transition_raises():
    c = StateCounters(1)
    with pytest.raises(IllegalTransition, match="FREE -> COMPUTE"):
        c.set(0, S.COMPUTE)
    c.set(0, S.HOLD)
    with pytest.raises(IllegalTransition):
        c.set(0, S.FREE)
