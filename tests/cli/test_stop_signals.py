"""Ctrl-C handling of ``infinity train`` (StopSignals), with real signals sent to this process."""

from __future__ import annotations

import os
import signal

import pytest

from infinity.cli.train.loop import StopSignals


def _interrupt() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    # NOTE: Python runs the handler at the next bytecode boundary of the main thread.
    for _ in range(100):
        pass


def test_first_signal_asks_to_stop_and_the_second_abandons_at_once():
    notes: list[str] = []
    with StopSignals(notes.append) as stop:
        _interrupt()
        assert stop.requested and stop.abandon_signum is None
        assert len(notes) == 1 and "Ctrl-C again" in notes[0]
        reached = False
        with pytest.raises(KeyboardInterrupt):
            _interrupt()
            reached = True
        assert not reached
        assert stop.abandon_signum == signal.SIGINT
        assert stop.interruption == "the current step was abandoned"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_signal_in_a_deferred_region_lets_it_finish_then_abandons():
    with StopSignals(lambda _note: None) as stop:
        _interrupt()
        finished = False
        with pytest.raises(KeyboardInterrupt):
            with stop.deferred("the plot"):
                _interrupt()
                assert stop.abandon_signum == signal.SIGINT
                _interrupt()  # a third one changes nothing
                finished = True
        assert finished
        assert stop.interruption == "stopped after the plot"


def test_a_deferred_region_without_a_second_signal_ends_normally():
    with StopSignals(lambda _note: None) as stop:
        _interrupt()
        with stop.deferred("the plot"):
            pass
        assert stop.requested and stop.abandon_signum is None
        # the region is over: a second signal abandons at once again
        with pytest.raises(KeyboardInterrupt):
            _interrupt()
