"""The per-chunk optimizer-update lifecycle: every legal path, every illegal move raises,
and a read of a chunk whose update is queued raises instead of returning stale bytes."""

from __future__ import annotations

import itertools

import pytest

from infinity.chunks.states import (
    LEGAL_UPDATE_TRANSITIONS,
    IllegalTransition,
    IllegalUpdateTransition,
    StaleRead,
    UpdateStates,
)
from infinity.chunks.states import UpdateState as U

ILLEGAL = sorted(set(itertools.product(U, U)) - LEGAL_UPDATE_TRANSITIONS)
# Each state reached by the engine's own moves from IDLE.
PATHS = {
    U.IDLE: [],
    U.EARLY: [U.EARLY],
    U.STEPPED: [U.EARLY, U.RUNNING, U.STEPPED],
    U.TRAILING: [U.TRAILING],
    U.RUNNING: [U.TRAILING, U.RUNNING],
    U.COMPUTING: [U.TRAILING, U.RUNNING, U.COMPUTING],
}


def _at(state: U) -> UpdateStates:
    u = UpdateStates(1)
    for step in PATHS[state]:
        u.set(0, step)
    assert u[0] is state
    return u


@pytest.mark.parametrize(
    "path",
    [
        [U.EARLY, U.RUNNING, U.STEPPED, U.IDLE],  # overlapped: run during backward
        [U.STEPPED, U.IDLE],  # overlapped, nothing of the chunk to update
        [U.EARLY, U.TRAILING, U.RUNNING, U.IDLE],  # queued in backward, trails the step
        [U.EARLY, U.RUNNING, U.IDLE],  # queued in backward, run by step()
        [U.TRAILING, U.RUNNING, U.IDLE],  # NVMe-bound: trails into the next forward
        [U.RUNNING, U.IDLE],  # host-only: run by step()
        # host-only, deferred into the forward, its kernels on the update worker
        [U.TRAILING, U.RUNNING, U.COMPUTING, U.RUNNING, U.IDLE],
    ],
    ids=lambda path: "-".join(s.name for s in path),
)
def test_every_path_of_one_step_returns_to_idle(path):
    u = UpdateStates(2)
    for state in path:
        u.set(0, state)
        assert u[0] is state and u[1] is U.IDLE
        assert u.count(U.IDLE) == (2 if state is U.IDLE else 1) and sum(u.counts) == 2


@pytest.mark.parametrize(("old", "new"), sorted(LEGAL_UPDATE_TRANSITIONS), ids=lambda s: s.name)
def test_every_legal_transition_is_allowed(old, new):
    u = _at(old)
    u.set(0, new)
    assert u[0] is new


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=lambda s: s.name)
def test_every_illegal_transition_raises_naming_chunk_and_states(old, new):
    u = _at(old)
    with pytest.raises(IllegalUpdateTransition, match=f"chunk 0: {old.name} -> {new.name}"):
        u.set(0, new)
    assert u[0] is old and u.count(old) == 1  # nothing changed
    assert isinstance(IllegalUpdateTransition("x"), IllegalTransition)


def test_derived_predicates():
    u = UpdateStates(3)
    assert not u.stepped_in_backward
    u.set(0, U.EARLY)
    u.set(1, U.TRAILING)
    assert u.queued(0) and u.queued(1) and not u.queued(2)
    assert u.trailing(1) and not u.trailing(0)
    assert u.stepped_in_backward
    assert u.indices_in(U.EARLY, U.TRAILING) == {0, 1}
    u.set(0, U.RUNNING)
    u.set(0, U.STEPPED)
    assert u.stepped_in_backward and not u.queued(0)
    for state in (U.TRAILING, U.RUNNING, U.COMPUTING):  # kernels on the update worker
        u.set(2, state)
    assert u.queued(2) and not u.trailing(2)  # stale until closed, no longer trailing


@pytest.mark.parametrize("state", list(U), ids=lambda s: s.name)
def test_reading_a_queued_chunk_raises(state):
    u = _at(state)
    if state in (U.EARLY, U.TRAILING, U.COMPUTING):
        with pytest.raises(StaleRead, match=f"chunk 0 .*{state.name}"):
            u.check_readable(0)
    else:
        u.check_readable(0)
    # host reads let a chunk queued during backward pass (overlap_optimizer)
    if state in (U.TRAILING, U.COMPUTING):
        with pytest.raises(StaleRead):
            u.check_readable(0, early=False)
    else:
        u.check_readable(0, early=False)


@pytest.mark.parametrize("state", list(U), ids=lambda s: s.name)
def test_ensure_readable_runs_the_queued_update_through_the_runner(state):
    """Reading settles by construction: a queued chunk's update is run (by the
    runner the update pipeline registers) before the read, and only then."""
    u = _at(state)
    ran: list[int] = []

    def runner(chunk: int) -> None:
        ran.append(chunk)
        u.set(chunk, U.RUNNING)
        u.set(chunk, U.STEPPED if state is U.EARLY else U.IDLE)

    u.runner = runner
    u.ensure_readable(0)
    assert ran == ([0] if state in (U.EARLY, U.TRAILING, U.COMPUTING) else [])
    assert not u.queued(0)


def test_ensure_readable_raises_when_the_runner_leaves_the_update_queued():
    u = _at(U.TRAILING)
    u.runner = lambda chunk: None  # a runner that does not run it
    with pytest.raises(StaleRead, match="chunk 0 .*TRAILING"):
        u.ensure_readable(0)
    u.runner = None  # no pipeline at all: the read is refused too
    with pytest.raises(StaleRead):
        u.ensure_readable(0, early=False)
