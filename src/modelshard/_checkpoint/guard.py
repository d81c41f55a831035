"""Exit safety: no asynchronous save is lost, silently or otherwise, when the process ends.

Not ``atexit``: Python 3.12 starts no thread once the interpreter finalizes, and a save in
flight needs threads to finish. Three moments are watched, for every live manager:

- the end of the ``__main__`` module, normal or by an exception (``sys.monitoring``);
- SIGTERM and SIGINT, through our handler (see ``on_signal``);
- the interpreter's own shutdown, if neither came first (a REPL, an embedding): finishing
  is impossible then, so the lost steps are printed and the exit status is 1.

A stop request (the first SIGTERM/SIGINT while a training loop polls
[`should_save`][modelshard.CheckpointManager.should_save]) is a preemption: the loop saves
its current step, and the process exits with ``128 + signal`` when the main module ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import weakref
from typing import Any

from .._base import CheckpointError

_lock = threading.RLock()
_live: weakref.WeakSet[Any] = weakref.WeakSet()
_installed = False
_stop: list[int] = []  # the signal that asked this process to stop, if any
_forwarded: list[int] = []  # a signal handed to JAX's preemption service (see on_signal)
_failed: list[str] = []
_previous: dict[int, Any] = {}
_tool: list[int] = []
_TOOL_NAME = "modelshard-exit-guard"


def stop_signal() -> int | None:
    """The signal that asked the process to stop (preemption), or None."""
    return _stop[0] if _stop else None


def _say(text: str) -> None:
    try:
        sys.stderr.write(f"modelshard: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def finish_all(why: str) -> None:
    """Finish every live manager's pending save; report (loudly) each one that fails."""
    for mngr in list(_live):
        step = mngr.pending_step()
        if step is None:
            continue
        try:
            mngr.wait_until_finished()
        except BaseException as e:  # reported, and the exit status says so
            msg = (
                str(e)
                if isinstance(e, CheckpointError)
                else f"step {step} was not saved to {mngr.directory}: {type(e).__name__}: {e}"
            )
            _failed.append(msg)
            _say(f"NOT SAVED ({why}): {msg}")


def _install_monitoring() -> None:
    mon = getattr(sys, "monitoring", None)
    main = sys.modules.get("__main__")
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    code = None  # the outermost frame of the main module's code
    while frame is not None:
        if (
            frame.f_code.co_name == "<module>"
            and main is not None
            and frame.f_globals is vars(main)
        ):
            code = frame.f_code
        frame = frame.f_back
    if mon is None or code is None:
        return
    tool = next((t for t in (4, 3) if mon.get_tool(t) is None), None)
    if tool is None:
        return
    mon.use_tool_id(tool, _TOOL_NAME)

    def on_return(c: Any, offset: int, value: Any) -> Any:
        if c is code:
            finish_all("the main module ended")
            if _failed:
                raise SystemExit(1)
            if _stop:
                raise SystemExit(128 + _stop[0])
        return mon.DISABLE

    def on_unwind(c: Any, offset: int, exc: BaseException) -> Any:
        if c is code:
            if isinstance(exc, SystemExit) and not _failed and stop_signal() is None:
                finish_all("sys.exit")
                if _failed:
                    raise SystemExit(1)
                return None
            finish_all(f"the main module raised {type(exc).__name__}")
            if stop_signal() is not None and isinstance(exc, SystemExit):
                raise SystemExit(128 + stop_signal())  # type: ignore[operator]
        return None

    mon.register_callback(tool, mon.events.PY_RETURN, on_return)
    mon.register_callback(tool, mon.events.PY_UNWIND, on_unwind)
    mon.set_local_events(tool, code, mon.events.PY_RETURN)
    _tool.append(tool)
    pending_changed()


def pending_changed() -> None:
    """Watch the main module's unwinding (a global event: every frame that exits by an
    exception calls back) only while some save is pending or a stop was requested."""
    mon = getattr(sys, "monitoring", None)
    if mon is None or not _tool:
        return
    pending = _stop or any(m.pending_step() is not None for m in list(_live))
    mon.set_events(_tool[0], mon.events.PY_UNWIND if pending else 0)


def _at_shutdown() -> None:
    """Runs before Python joins threads: too late to write, so say what was lost."""
    lost = [(m.directory, m.unfinished_step()) for m in list(_live)]
    lost = [(directory, step) for directory, step in lost if step is not None]
    for directory, step in lost:
        _say(
            f"the interpreter is exiting while step {step} of {directory} is still being "
            "written; it cannot be finished now and is LOST. Call close() (or use the "
            "manager in a `with` block) before the program ends."
        )
    if lost:  # (a failure already reported has set the exit status itself)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        os._exit(1)


def on_signal(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT: a stop request first, then (or if nobody polls) finish and die."""
    polled = any(m.has_polled() for m in list(_live))
    if polled and not _stop and not _forwarded and _forward_to_preemption_service(signum):
        return
    first = not _stop and not _forwarded
    if first:
        _stop.append(signum)
        pending_changed()
    if first and polled:
        _say(
            f"got signal {signum}: the training loop's next should_save(step) saves that "
            f"step; the process then exits with status {128 + signum}."
        )
        return
    finish_all(f"signal {signum}")
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _forward_to_preemption_service(signum: int) -> bool:
    """Hand the signal to JAX's preemption service as a SIGTERM, where it owns SIGTERM (under
    jax.distributed), so that every process stops at the same step (``reached_preemption``),
    not this one alone; whether it was handed over."""
    import jax

    from .._internals import global_state

    if jax.process_count() == 1 or global_state.preemption_sync_manager is None:
        return False
    _forwarded.append(signum)
    _say(
        f"got signal {signum}: every process saves the step JAX's preemption service agrees "
        "on (the loop's should_save(step)), then exits with status 143."
    )
    os.kill(os.getpid(), signal.SIGTERM)
    return True


def _install_signals() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    import jax

    signals = [signal.SIGINT]
    # Under jax.distributed, JAX's preemption service owns SIGTERM (C handler: getsignal
    # is None) and the sync point tells every process together.
    if jax.process_count() == 1:
        signals.append(signal.SIGTERM)
    for sig in signals:
        current = signal.getsignal(sig)
        if current is None or current == signal.SIG_IGN or current is on_signal:
            continue
        _previous[sig] = current
        signal.signal(sig, on_signal)


def watch(mngr: Any, *, handle_signals: bool) -> None:
    """Guard ``mngr``'s pending saves at every way the process can end."""
    global _installed
    with _lock:
        _live.add(mngr)
        if not _installed:
            _installed = True
            _install_monitoring()
            threading._register_atexit(_at_shutdown)  # type: ignore[attr-defined]
        if handle_signals:
            _install_signals()


def unwatch(mngr: Any) -> None:
    with _lock:
        _live.discard(mngr)
        pending_changed()


def request_stop(signum: int) -> None:
    """Record a stop request that arrived another way (JAX's preemption sync point)."""
    if not _stop:
        _stop.append(signum)
        pending_changed()


def clear_stop() -> None:
    """Forget a stop request (tests, and loops that decide to carry on)."""
    _stop.clear()
