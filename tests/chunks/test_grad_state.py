"""The per-chunk gradient lifecycle: every legal path, every illegal move raises."""

from __future__ import annotations

import itertools

import pytest

from infinity.chunks.states import (
    LEGAL_GRAD_TRANSITIONS,
    GradStates,
    IllegalGradTransition,
    IllegalTransition,
)
from infinity.chunks.states import GradState as G

ILLEGAL = sorted(set(itertools.product(G, G)) - LEGAL_GRAD_TRANSITIONS)


def _at(state: G) -> GradStates:
    """A one-chunk record brought to ``state`` through the engine's own moves."""
    g = GradStates(1)
    moves = {
        G.NONE: [],
        G.RECEIVING: [g.slot_taken],
        G.FLUSHED: [g.slot_taken, g.flushed],
        G.ADDING: [g.slot_taken, g.flushed, g.slot_taken],
        G.CONSUMED: [g.slot_taken, g.flushed, g.consumed],
    }
    for move in moves[state]:
        move(0)
    assert g[0] is state
    return g


def test_one_accumulation_cycle_then_zero_grad():
    g = GradStates(2)
    assert not g.has_grads(0) and not g.on_device(0)
    g.slot_taken(0)
    g.written[0].append((0, 4))
    assert g[0] is G.RECEIVING and g.on_device(0) and not g.has_grads(0)
    g.flushed(0)
    assert g[0] is G.FLUSHED and g.has_grads(0) and g.home_valid(0) and not g.on_device(0)
    assert 0 not in g.written  # the slot's ranges go with it
    g.slot_taken(0)  # a second micro-batch: its flush adds
    assert g[0] is G.ADDING and g.home_valid(0) and g.on_device(0) and g.written[0] == []
    g.flushed(0)
    g.zeroed(0)
    assert g[0] is G.NONE and not g.has_grads(0)
    assert g[1] is G.NONE  # other chunks untouched


def test_consumed_gradients_count_as_present_but_not_readable():
    g = _at(G.CONSUMED)
    assert g.has_grads(0) and g.dropped(0) and not g.home_valid(0)
    g.zeroed(0)
    assert g[0] is G.NONE and not g.dropped(0)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (G.NONE, G.NONE),
        (G.RECEIVING, G.RECEIVING),
        (G.FLUSHED, G.NONE),
        (G.ADDING, G.RECEIVING),  # the device slot's gradients survive, the home's do not
        (G.CONSUMED, G.NONE),
    ],
)
def test_zeroing_forgets_the_home_only(before, after):
    g = _at(before)
    g.zeroed(0)
    assert g[0] is after


def test_zero_all():
    g = GradStates(3)
    g.slot_taken(0)
    g.flushed(0)
    g.slot_taken(1)
    g.zero_all()
    assert [g[i] for i in range(3)] == [G.NONE, G.RECEIVING, G.NONE]


@pytest.mark.parametrize(("old", "new"), sorted(LEGAL_GRAD_TRANSITIONS), ids=lambda s: s.name)
def test_every_legal_transition_is_allowed(old, new):
    g = _at(old)
    g.set(0, new)
    assert g[0] is new


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=lambda s: s.name)
def test_every_illegal_transition_raises_naming_chunk_and_states(old, new):
    g = _at(old)
    with pytest.raises(IllegalGradTransition, match=f"chunk 0: {old.name} -> {new.name}"):
        g.set(0, new)
    assert g[0] is old  # nothing changed


def test_illegal_moves_of_the_engine_raise():
    with pytest.raises(IllegalTransition, match="NONE -> FLUSHED"):
        GradStates(1).flushed(0)  # a flush without a device slot
    with pytest.raises(IllegalTransition, match="ADDING -> CONSUMED"):
        _at(G.ADDING).consumed(0)  # dropping what is still being added to
    with pytest.raises(IllegalTransition, match="RECEIVING -> RECEIVING"):
        _at(G.RECEIVING).slot_taken(0)  # two device slots for one chunk
