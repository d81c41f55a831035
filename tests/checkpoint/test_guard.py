"""The exit guard (``_checkpoint/guard.py``) in this process: every live manager's pending
save finished on demand, a stop request (SIGTERM/SIGINT to a loop that polls
``should_save``) turning the next step into a saving step, and the unwinding watch on only
while something is pending. Exits themselves (end of script, ``sys.exit``, signals, the
interpreter's shutdown) need a process of their own: ``test_manager_exit.py``."""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from modelshard._checkpoint import guard
from modelshard._checkpoint.listing import is_complete_step


def _w(step):
    return {"w": jnp.arange(8.0) + step}


@pytest.fixture
def stop_cleared() -> Iterator[None]:
    """A stop request made in the test is forgotten after it (the guard would otherwise
    end pytest's own process with ``128 + signal``)."""
    guard.clear_stop()
    try:
        yield
    finally:
        guard.clear_stop()
        guard.pending_changed()


def test_finish_all_finishes_every_live_managers_pending_save(tmp_path):
    managers = [ms.CheckpointManager(tmp_path / n, handle_signals=False) for n in ("a", "b")]
    try:
        for i, mngr in enumerate(managers):
            assert mngr.save(i, _w(i))
            assert mngr.pending_step() == i
        guard.finish_all("the test asked")
        for i, mngr in enumerate(managers):
            assert mngr.pending_step() is None
            assert is_complete_step(mngr.step_directory(i))
            np.testing.assert_array_equal(mngr.restore(i)["w"], np.asarray(_w(i)["w"]))
    finally:
        for mngr in managers:
            mngr.close()


def test_a_first_signal_to_a_polling_loop_is_a_stop_request(tmp_path, capsys, stop_cleared):
    """The loop's next ``should_save`` is True whatever the interval, that step is saved
    (complete when ``save`` returns), and the process is told how it will exit."""
    with ms.CheckpointManager(tmp_path, save_interval_steps=100, handle_signals=False) as mngr:
        assert not mngr.should_save(3)  # polled: the loop handles stops itself
        guard.on_signal(signal.SIGTERM, None)
        assert guard.stop_signal() == signal.SIGTERM
        assert "got signal 15: the training loop's next should_save(step) saves that step; " in (
            capsys.readouterr().err
        )
        assert mngr.should_save(4)
        assert mngr.save(4, _w(4))
        assert mngr.pending_step() is None and is_complete_step(mngr.step_directory(4))
        guard.request_stop(signal.SIGINT)  # a later request keeps the first
        assert guard.stop_signal() == signal.SIGTERM
        guard.clear_stop()
        assert guard.stop_signal() is None
        assert not mngr.should_save(5)
        assert mngr.all_steps() == [4]


def test_a_manager_handling_signals_installs_the_guards_handler(tmp_path):
    with ms.CheckpointManager(tmp_path, handle_signals=True):
        assert signal.getsignal(signal.SIGINT) is guard.on_signal
        assert signal.getsignal(signal.SIGTERM) is guard.on_signal


def test_the_unwinding_watch_is_on_only_while_a_save_is_pending(tmp_path, stop_cleared):
    """Every frame leaving by an exception calls the guard back while the watch is on, so
    it is on only while a save is pending or a stop was requested."""
    mon = getattr(sys, "monitoring", None)
    if mon is None:
        pytest.skip("no sys.monitoring before Python 3.12: the guard watches no unwinding")
    with ms.CheckpointManager(tmp_path, handle_signals=False) as mngr:
        tool = next((t for t in range(6) if mon.get_tool(t) == "modelshard-exit-guard"), None)
        if tool is None:
            pytest.skip("the guard watches no __main__ module in this process")
        gc.collect()  # managers of earlier tests, dropped but not collected yet
        assert mon.get_events(tool) == 0
        mngr.save(0, _w(0))
        assert mon.get_events(tool) == mon.events.PY_UNWIND
        mngr.wait_until_finished()
        assert mon.get_events(tool) == 0
        guard.request_stop(signal.SIGTERM)
        assert mon.get_events(tool) == mon.events.PY_UNWIND
        guard.clear_stop()
        guard.pending_changed()
        assert mon.get_events(tool) == 0
