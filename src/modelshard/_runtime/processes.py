"""``modelshard launch``: N local processes on JAX's distributed runtime, as one command."""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

# What each process finds in its environment; modelshard.distributed.initialize reads it.
# This module imports no JAX, so it also runs as a plain script (fast start-up in tests).
ENV_COORDINATOR = "MODELSHARD_COORDINATOR"
ENV_NUM_PROCESSES = "MODELSHARD_NUM_PROCESSES"
ENV_PROCESS_ID = "MODELSHARD_PROCESS_ID"
ENV_LOCAL_DEVICES = "MODELSHARD_LOCAL_DEVICES"
# jax.distributed.initialize's heartbeat_timeout_seconds: a silent process is declared dead
ENV_HEARTBEAT_TIMEOUT = "MODELSHARD_HEARTBEAT_TIMEOUT"
# how long modelshard's barriers wait (DEFAULT_BARRIER_TIMEOUT_S unset)
ENV_BARRIER_TIMEOUT = "MODELSHARD_BARRIER_TIMEOUT"
# glibc's malloc arenas: one per launched process unless the caller's environment says
ENV_MALLOC_ARENA_MAX = "MALLOC_ARENA_MAX"

# Gloo's per-peer "connected" lines are noise. Its threads write them in pieces, which may
# land inside another line: the pieces are removed wherever they are (``_without_noise``).
_NOISE = re.compile(
    rb"(?:\[Gloo\] Rank )*\d* ?is connected to \d+ peer ranks\. "
    rb"Expected number of connected peer ranks is : \d+\r?\n?"
    rb"|\[Gloo\] Rank (?!\d)"
)
_POLL_S = 0.02
DEFAULT_GRACE_S = 30.0
"""Seconds between the SIGTERM that stops the processes and the SIGKILL: time for the
preemption save of each."""
FAILURE_GRACE_S = 3.0
"""The grace after a failure or a timeout (at most ``--grace``): the others cannot finish a
save that needs the failed process."""
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="modelshard launch",
        description="Run a command as N local processes on JAX's distributed runtime (CPU "
        "devices, gloo collectives), the way a cluster launcher would.",
        epilog="example: modelshard launch -n 2 --devices-per-process 4 -- python train.py. "
        "The script calls modelshard.distributed.initialize() first; the same script "
        "then runs alone, under launch, or under SLURM/mpirun/a TPU pod.",
    )
    p.add_argument(
        "-n",
        "--num-processes",
        type=int,
        required=True,
        metavar="N",
        help="how many processes to start",
    )
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=1,
        metavar="K",
        help="simulated CPU devices per process (default 1)",
    )
    p.add_argument(
        "--timeout", type=float, metavar="S", help="stop every process after S seconds and exit 124"
    )
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="S",
        help="seconds between the SIGTERM forwarded to the processes (the launcher got a "
        "signal, or one process stopped on SIGTERM) and SIGKILL: time for their preemption "
        f"save (default {DEFAULT_GRACE_S:g}); a process still running then is killed, "
        f"named, and the exit status is 137. After a failure or --timeout: at most "
        f"{FAILURE_GRACE_S:g}",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        metavar="S",
        help="seconds after which the distributed runtime declares a silent process dead "
        f"and stops the others (sets {ENV_HEARTBEAT_TIMEOUT}; default: JAX's 100)",
    )
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument(
        "--show-gloo",
        action="store_true",
        help="keep gloo's per-peer 'connected' lines in the output",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after `--`")
    return p


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (``reserve_port`` holds one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reserve_port() -> socket.socket | None:
    """A socket holding a free port on 127.0.0.1 until closed (None without ``SO_REUSEPORT``)."""
    reuse = getattr(socket, "SO_REUSEPORT", None)
    if reuse is None:  # pragma: no cover - not Linux/macOS
        return None
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, reuse, 1)
        s.bind(("127.0.0.1", 0))
    except OSError:  # pragma: no cover - a kernel refusing the option
        s.close()
        return None
    return s


def _glibc() -> bool:
    """Whether this process (and so each it starts) runs on glibc."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # no such name: not glibc
        return False


def child_env(
    base: dict[str, str],
    coordinator: str,
    num: int,
    index: int,
    devices: int,
    heartbeat_timeout: float | None = None,
) -> dict[str, str]:
    """The environment of process ``index``: ``base`` plus what ``initialize`` reads."""
    env = dict(base)
    if ENV_MALLOC_ARENA_MAX not in env and _glibc():
        env[ENV_MALLOC_ARENA_MAX] = "1"
    if heartbeat_timeout is not None:
        env[ENV_HEARTBEAT_TIMEOUT] = f"{heartbeat_timeout:g}"
    env.update(
        {
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(num),
            ENV_PROCESS_ID: str(index),
            ENV_LOCAL_DEVICES: str(devices),
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(devices),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


# Between the launcher and each process on Linux: the kernel SIGKILLs the process if the
# launcher dies (PR_SET_PDEATHSIG). Not a preexec_fn: that forks a multithreaded launcher.
_EXEC_HELPER = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(128 + 9)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    sys.stderr.write(f"cannot start {sys.argv[2]!r}: {e.strerror or e}\\n")
    os._exit(127)
"""


def _cannot_start(program: str) -> str | None:
    """Why ``program`` cannot be executed (``strerror``-style), or ``None``."""
    path = program if os.sep in program else shutil.which(program)
    if path is None or not os.path.exists(path):
        return os.strerror(errno.ENOENT)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        return os.strerror(errno.EACCES)
    return None


def _without_noise(held: bytes, line: bytes) -> tuple[bytes | None, bytes]:
    """``(what to print, what to hold)`` for ``line`` read after ``held``, gloo's pieces removed."""
    text = _NOISE.sub(b"", held + line)
    if not text:
        return None, b""
    if line.endswith(b"\n") and not text.endswith(b"\n"):
        return None, text
    return text, b""


def _forward(
    stream: IO[bytes], out: Any, prefix: bytes, lock: threading.Lock, show_noise: bool
) -> None:
    sink = out.buffer if hasattr(out, "buffer") else None
    held = b""
    for read in itertools.chain(iter(stream.readline, b""), [None]):
        if read is None:  # the end: what was held is the program's last line
            line: bytes | None = held or None
        elif show_noise:
            line = read
        else:
            line, held = _without_noise(held, read)
        if line is None:
            continue
        if not line.endswith(b"\n"):
            line += b"\n"
        # an OSError or ValueError: our reader went away (`| head`), keep draining
        with lock, contextlib.suppress(OSError, ValueError):
            if sink is not None:
                sink.write(prefix + line)
            else:
                out.write((prefix + line).decode("utf-8", "replace"))
            out.flush()
    stream.close()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> list[int]:
    """SIGTERM every process group, SIGKILL them after ``grace``; the indices still running then."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in running):
        time.sleep(_POLL_S)
    killed = [i for i, p in enumerate(procs) if p.poll() is None]
    for p in procs:  # also reaps grandchildren left in the group of a finished process
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        p.wait()
    return killed


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _stopped(rc: int) -> str | None:
    """The stop signal (SIGTERM, SIGINT) a process ended on, directly or as ``128 + signal``."""
    for sig in _STOP_SIGNALS:
        if rc in (128 + sig, -sig):
            return signal.Signals(sig).name
    return None


def _status_text(rc: int) -> str:
    """A process's exit status as the end-of-run report says it."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"{_exit_code(rc)} (killed by {name})"
    stop = _stopped(rc)
    return f"{rc} (stopped on {stop})" if stop else str(rc)


def run(
    command: Sequence[str],
    num: int,
    devices: int = 1,
    *,
    timeout: float | None = None,
    grace: float = DEFAULT_GRACE_S,
    port: int | None = None,
    show_gloo: bool = False,
    heartbeat_timeout: float | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> int:
    """Run ``command`` as ``num`` processes; return 0 if all succeed, else a failing code."""
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    lock = threading.Lock()

    def note(text: str) -> None:
        with lock:
            stderr.write(f"[modelshard launch] {text}\n")
            stderr.flush()

    why = _cannot_start(command[0])
    if why is not None:
        note(f"cannot start {command[0]!r}: {why}")
        return 127
    reservation = reserve_port() if port is None else None
    if port is None:
        port = reservation.getsockname()[1] if reservation is not None else free_port()
    coordinator = f"127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []
    status = 0
    stop_grace = min(grace, FAILURE_GRACE_S)  # unless the run is stopped by a signal
    interrupted: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda signum, _: interrupted.append(signum))
    argv = list(command)
    if sys.platform.startswith("linux"):  # through _EXEC_HELPER
        argv = [sys.executable, "-S", "-c", _EXEC_HELPER, str(os.getpid()), *argv]
    try:
        for i in range(num):
            env = child_env(dict(os.environ), coordinator, num, i, devices, heartbeat_timeout)
            try:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as e:
                note(f"cannot start {command[0]!r}: {e.strerror or e}")
                return 127
            procs.append(proc)
            prefix = f"[process {i}] ".encode()
            for stream, out in ((proc.stdout, stdout), (proc.stderr, stderr)):
                assert stream is not None
                t = threading.Thread(
                    target=_forward, args=(stream, out, prefix, lock, show_gloo), daemon=True
                )
                t.start()
                threads.append(t)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c is not None and c != 0]
            if failed:
                i, c = failed[0]
                status = _exit_code(c)
                stop = _stopped(c)
                if stop is not None:  # asked to stop (preempted): not a failure
                    stop_grace = grace
                    stopping = f"{stop}; stopping the others (--grace {grace:g} s)"
                    note(f"process {i} stopped on {stopping}")
                else:
                    note(f"process {i} exited with code {c}; stopping the others")
                break
            if all(c == 0 for c in codes):
                break
            if interrupted:
                stop_grace = grace
                status = 128 + interrupted[0]
                stopping = f"SIGTERM, then SIGKILL after --grace {grace:g} s"
                note(f"got signal {interrupted[0]}; stopping every process ({stopping})")
                break
            if deadline is not None and time.monotonic() > deadline:
                status = 124
                note(f"timed out after {timeout:g} s; stopping every process")
                break
            time.sleep(_POLL_S)
    finally:
        killed = _stop(procs, stop_grace)
        for t in threads:
            t.join(timeout=2.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if reservation is not None:
            reservation.close()
    # More --grace helps only a stop by a signal; after a failure or --timeout the grace is
    # capped (FAILURE_GRACE_S): a save needing the failed process cannot finish anyway.
    more = (
        "give it more time with --grace"
        if interrupted
        else f"after a failure or --timeout the others get at most {FAILURE_GRACE_S:g} s "
        "(--grace is the time a stop by a signal gives)"
    )
    for i in killed:
        note(
            f"process {i} was still running {stop_grace:g} s after SIGTERM and was killed: "
            f"whatever it was saving (a checkpoint) was cut short; {more}"
        )
    if killed and (status == 0 or _stopped(status) is not None):
        status = 128 + signal.SIGKILL  # not the status of a clean stop
    codes = [p.returncode for p in procs]
    if status != 0 and len(codes) == num:
        report = ", ".join(f"process {i} {_status_text(c)}" for i, c in enumerate(codes))
        note(f"exit status: {report}")
    return status


def main(argv: list[str]) -> int:
    """``modelshard launch -n N [--devices-per-process K] [--timeout S] -- command ...``."""
    parser = _parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error(
            "no command given; put it after `--`, e.g. modelshard launch -n 2 -- python train.py"
        )
    if args.num_processes < 1:
        parser.error(f"-n must be at least 1, got {args.num_processes}")
    if args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be at least 1, got {args.devices_per_process}")
    if args.heartbeat_timeout is not None and not 0 < args.heartbeat_timeout < float("inf"):
        parser.error(
            f"--heartbeat-timeout must be a positive number of seconds, got "
            f"{args.heartbeat_timeout:g}"
        )
    names = ("timeout", "grace", "port", "show_gloo", "heartbeat_timeout")
    options = {k: getattr(args, k) for k in names}  # run's keyword options, as parsed
    return run(command, args.num_processes, args.devices_per_process, **options)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
