"""The launcher (``_runtime/processes.py``): environment, prefixed output, exit codes, and
nothing left behind.

These tests start plain Python children (no JAX), so they are fast; the JAX runs are in
``test_multiprocess.py``.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from modelshard._runtime import processes as _launch
from modelshard._runtime.processes import child_env, free_port, main, run

PY = sys.executable
# The launcher runs as a plain script (it imports no JAX), as fast as a launcher can start.


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def all_gone(pids: list[int], within_s: float = 10.0) -> bool:
    """Whether every process of ``pids`` is gone within ``within_s``: a process killed a
    moment ago may still be tearing down (its memory unmapped) on a loaded machine."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not any(alive(p) for p in pids)


def wait_for(path: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.02)
    raise AssertionError(f"{path} was not written within {timeout} s")


def launch(code: str, n: int, **kw) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run([PY, "-c", textwrap.dedent(code)], n, stdout=out, stderr=err, **kw)
    return rc, out.getvalue(), err.getvalue()


def test_every_process_gets_its_environment_and_a_prefix():
    rc, out, err = launch(
        """
        import os, sys
        e = os.environ
        print(e["MODELSHARD_PROCESS_ID"], e["MODELSHARD_NUM_PROCESSES"],
              e["MODELSHARD_LOCAL_DEVICES"], e["MODELSHARD_COORDINATOR"], e["JAX_PLATFORMS"])
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """,
        3,
        devices=4,
        timeout=60,
    )
    assert rc == 0, err
    lines = out.splitlines()
    coords = set()
    for i in range(3):
        mine = [ln for ln in lines if ln.startswith(f"[process {i}] ")]
        assert len(mine) == 2, out
        pid, num, dev, coord, platform = mine[0].split()[2:]
        assert (pid, num, dev, platform) == (str(i), "3", "4", "cpu")
        assert coord.startswith("127.0.0.1:")
        coords.add(coord)
        assert mine[1] == f"[process {i}] no newline at the end"
        assert f"[process {i}] to stderr" in err.splitlines()
    assert len(coords) == 1  # one coordinator for all


def test_child_env_and_free_port():
    env = child_env({"KEEP": "1", "JAX_PLATFORMS": "tpu"}, "127.0.0.1:5", 4, 2, 8)
    assert env["KEEP"] == "1"
    assert env["JAX_PLATFORMS"] == "cpu"
    assert (
        env["MODELSHARD_COORDINATOR"],
        env["MODELSHARD_NUM_PROCESSES"],
        env["MODELSHARD_PROCESS_ID"],
        env["MODELSHARD_LOCAL_DEVICES"],
        env["JAX_NUM_CPU_DEVICES"],
    ) == ("127.0.0.1:5", "4", "2", "8", "8")
    assert 0 < free_port() < 65536
    assert "MODELSHARD_HEARTBEAT_TIMEOUT" not in env  # unset: JAX's default applies
    assert child_env({}, "127.0.0.1:5", 4, 2, 8, 7)["MODELSHARD_HEARTBEAT_TIMEOUT"] == "7"


def test_child_env_keeps_one_malloc_arena_unless_set():
    glibc = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    env = child_env({}, "127.0.0.1:5", 2, 0, 4)
    # glibc reads it at start; elsewhere nothing reads it and nothing is set
    assert env.get("MALLOC_ARENA_MAX") == ("1" if glibc else None)
    assert child_env({"MALLOC_ARENA_MAX": "8"}, "127.0.0.1:5", 2, 0, 4)["MALLOC_ARENA_MAX"] == "8"


def test_heartbeat_timeout_reaches_every_process(capfd):
    code = "import os; print(os.environ.get('MODELSHARD_HEARTBEAT_TIMEOUT'))"
    assert main(["-n", "2", "--heartbeat-timeout", "7", "--", PY, "-c", code]) == 0
    assert sorted(capfd.readouterr().out.splitlines()) == ["[process 0] 7", "[process 1] 7"]
    rc, out, err = launch(code, 1)
    assert (rc, out) == (0, "[process 0] None\n"), err


def test_main_forwards_output_and_returns_zero(capfd):
    assert main(["-n", "2", "--", PY, "-c", "print('hello')"]) == 0
    out = capfd.readouterr().out.splitlines()
    assert sorted(out) == ["[process 0] hello", "[process 1] hello"]


def test_gloo_connection_noise_is_dropped_unless_asked():
    code = (
        "import sys; print('[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
        "connected peer ranks is : 1', file=sys.stderr); print('kept', file=sys.stderr)"
    )
    _, _, err = launch(code, 1)
    assert err.splitlines() == ["[process 0] kept"]
    # gloo's threads write concurrently: two messages may share a line, then split
    mixed = (
        "import sys; print('[Gloo] Rank [Gloo] Rank 3 is connected to 7 peer ranks. Expected "
        "number of connected peer ranks is : 7\\n2 is connected to 7 peer ranks. Expected "
        "number of connected peer ranks is : 7', file=sys.stderr)"
    )
    assert launch(mixed, 1)[2] == ""
    _, _, err = launch(code, 1, show_gloo=True)
    assert len(err.splitlines()) == 2


GLOO = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


@pytest.mark.parametrize(
    ("pieces", "printed"),
    [
        # the program's line cut by a whole message (gloo's newline with it)
        (["step 1", f"{GLOO}\n", " of 3\n"], ["step 1 of 3"]),
        # gloo's first piece, then the program's line, then the rest of the message
        (["[Gloo] Rank ", "kept\n", GLOO.removeprefix("[Gloo] Rank ") + "\n"], ["kept"]),
        # a message and the program's line written as one line
        ([f"before {GLOO}", " after\n"], ["before  after"]),
        # two messages of two threads, one inside the other, around the program's lines
        (
            ["a\n", "[Gloo] Rank ", f"{GLOO}\n", "b\n", GLOO.removeprefix("[Gloo] Rank "), "\n"],
            ["a", "b"],
        ),
        # the program's last words without a newline, after a message
        ([f"{GLOO}\n", "last"], ["last"]),
        # nothing but noise
        ([f"{GLOO}\n", f"{GLOO}\n"], []),
    ],
)
def test_gloo_messages_inside_other_output_are_cut_out_exactly(pieces, printed):
    """Gloo's threads and the program write to one stream at once: whatever the order of
    the pieces, every gloo piece is removed and every byte of the program's own output
    comes out as written, one prefixed line per line the program wrote."""
    code = f"""
        import os
        for piece in {pieces!r}:
            os.write(2, piece.encode())
    """
    rc, _, err = launch(code, 1)
    assert rc == 0
    assert err.splitlines() == [f"[process 0] {line}" for line in printed]
    # asked for, the output is as the processes wrote it
    _, _, raw = launch(code, 1, show_gloo=True)
    assert raw.replace("[process 0] ", "") == "".join(pieces) + (
        "" if "".join(pieces).endswith("\n") else "\n"
    )


def test_one_failure_stops_the_rest_and_leaves_no_process(tmp_path):
    # Process 0 ignores SIGTERM (as JAX does in a collective) and has a grandchild;
    # process 1 fails. Both must be gone, SIGKILLed after the grace period.
    code = f"""
        import os, signal, subprocess, sys, time
        i = int(os.environ["MODELSHARD_PROCESS_ID"])
        if i == 1:
            open({str(tmp_path)!r} + "/ready1", "w").close()
            while not os.path.exists({str(tmp_path)!r} + "/pids0"):
                time.sleep(0.01)
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "300"])
        with open({str(tmp_path)!r} + "/pids0.tmp", "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        os.rename({str(tmp_path)!r} + "/pids0.tmp", {str(tmp_path)!r} + "/pids0")
        time.sleep(300)
    """
    t0 = time.monotonic()
    rc, _, err = launch(code, 2, grace=0.5, timeout=60)
    elapsed = time.monotonic() - t0
    assert rc == 3
    assert "[modelshard launch] process 1 exited with code 3; stopping the others" in err
    assert (
        "[modelshard launch] process 0 was still running 0.5 s after SIGTERM and was killed: "
        "whatever it was saving (a checkpoint) was cut short; after a failure or --timeout "
        "the others get at most 3 s (--grace is the time a stop by a signal gives)"
    ) in err.splitlines()
    assert elapsed < 30
    pids = [int(p) for p in (tmp_path / "pids0").read_text().split()]
    assert all_gone(pids), pids


def test_a_process_killed_by_a_signal_gives_128_plus_signal():
    rc, _, err = launch(
        """
        import os, signal
        if os.environ["MODELSHARD_PROCESS_ID"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        import time; time.sleep(300)
    """,
        2,
        grace=0.2,
        timeout=60,
    )
    assert rc == 128 + signal.SIGKILL
    assert "process 0 exited with code -9" in err


def test_timeout_stops_everything_and_returns_124():
    t0 = time.monotonic()
    rc, _, err = launch("import time; time.sleep(300)", 2, timeout=0.5, grace=0.2)
    assert rc == 124
    assert time.monotonic() - t0 < 20
    assert "timed out after 0.5 s" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_killing_the_launcher_kills_its_processes(tmp_path):
    code = f"import os, time; open({str(tmp_path)!r} + '/pid' + os.environ['MODELSHARD_PROCESS_ID'], 'w').write(str(os.getpid())); time.sleep(300)"
    launcher = subprocess.Popen(
        [PY, _launch.__file__, "-n", "2", "--", PY, "-c", code],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        pids = [int(wait_for(tmp_path / f"pid{i}")) for i in range(2)]
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    assert all_gone(pids), pids


def test_sigterm_to_the_launcher_stops_everything(tmp_path):
    code = f"import os, time; open({str(tmp_path)!r} + '/pid' + os.environ['MODELSHARD_PROCESS_ID'], 'w').write(str(os.getpid())); time.sleep(300)"
    launcher = subprocess.Popen(
        [PY, _launch.__file__, "-n", "2", "--grace", "0.2", "--", PY, "-c", code],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        pids = [int(wait_for(tmp_path / f"pid{i}")) for i in range(2)]
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=20)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM
    assert b"got signal 15; stopping every process" in err
    assert all_gone(pids), pids


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2"], "no command given; put it after `--`"),
        (["-n", "2", "--"], "no command given; put it after `--`"),
        (["-n", "0", "--", "true"], "-n must be at least 1, got 0"),
        (
            ["-n", "2", "--devices-per-process", "0", "--", "true"],
            "--devices-per-process must be at least 1, got 0",
        ),
        (["--", "true"], "the following arguments are required: -n/--num-processes"),
        (
            ["-n", "2", "--heartbeat-timeout", "0", "--", "true"],
            "--heartbeat-timeout must be a positive number of seconds, got 0",
        ),
    ],
)
def test_bad_arguments_exit_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_help_names_the_distributed_entry_point(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "modelshard launch" in out
    assert "modelshard.distributed.initialize()" in out


def test_the_modelshard_command_routes_launch_here(capfd):
    from modelshard.cli import main as cli

    assert cli(["launch", "-n", "2", "--", PY, "-c", "print('via the CLI')"]) == 0
    assert sorted(capfd.readouterr().out.splitlines()) == [
        "[process 0] via the CLI",
        "[process 1] via the CLI",
    ]


def test_a_command_that_cannot_start_returns_127():
    err = io.StringIO()
    rc = run(["/nonexistent/python", "-c", "pass"], 2, stdout=io.StringIO(), stderr=err)
    assert rc == 127
    assert err.getvalue() == (
        "[modelshard launch] cannot start '/nonexistent/python': No such file or directory\n"
    )


def test_a_closed_output_does_not_block_the_processes():
    out = io.StringIO()
    out.close()  # like `modelshard launch ... | head` after head exits
    code = "import sys\nfor i in range(20000): print('x' * 100)"
    rc = run([PY, "-c", code], 2, stdout=out, stderr=io.StringIO(), timeout=60)
    assert rc == 0


_COORDINATOR_STANDIN = """
import os, socket, sys, time
host, port = os.environ["MODELSHARD_COORDINATOR"].rsplit(":", 1)
port = int(port)
if os.environ["MODELSHARD_PROCESS_ID"] == "0":
    plain = socket.socket()
    try:
        plain.bind((host, port))
    except OSError:
        pass  # held by the launcher: nobody else can take it
    else:
        sys.exit("the coordinator port was free for any program to take")
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as gRPC does
    server.bind((host, port))
    server.listen()
    for _ in range(int(os.environ["MODELSHARD_NUM_PROCESSES"]) - 1):
        conn, _ = server.accept()
        conn.sendall(b"ok")
        conn.close()
else:
    deadline = time.monotonic() + 20
    while True:
        try:
            c = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    assert c.recv(2) == b"ok"
"""


def test_many_launches_back_to_back_each_hold_their_coordinator_port():
    # Process 0 stands in for JAX's coordinator (a gRPC server: SO_REUSEPORT, then listen);
    # it checks that a program not sharing the port cannot bind it while the run lasts.
    ports = set()
    for _ in range(12):
        rc, out, err = launch(_COORDINATOR_STANDIN + "\nprint(port)", 2, timeout=60, grace=0.2)
        assert rc == 0, err
        ports.update(ln.split()[-1] for ln in out.splitlines())
    assert len(ports) >= 2  # a fresh port per run, released afterwards


def test_reserve_port_holds_the_port_until_closed():
    s = _launch.reserve_port()
    assert s is not None
    port = s.getsockname()[1]
    import socket

    other = socket.socket()
    with pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    s.close()
    other.bind(("127.0.0.1", port))  # released
    other.close()


def test_launching_from_a_multithreaded_program_does_not_fork_it():
    import threading
    import warnings

    import jax

    jax.devices()  # JAX's backend is up: it warns on any fork (its runtime is multithreaded)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    worker.start()  # the launcher's caller has threads (as JAX or a web server has)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rc, out, _ = launch("print('ok')", 2, timeout=60)
    finally:
        stop.set()
    assert rc == 0 and sorted(out.splitlines()) == ["[process 0] ok", "[process 1] ok"]
    assert not [w for w in caught if "fork" in str(w.message)]
