"""The journey matrix's worker: every case, in one process of a job, one JSON file per case.

Usage: ``journey_worker.py OUT [--peer DIR] [--only NAME ...]``, alone (1 process x 8
devices, ``JAX_NUM_CPU_DEVICES=8``) or under ``modelshard launch -n 2
--devices-per-process 4``. Each case runs on every process of the job, between two
coordination barriers, and writes ``OUT/results/<case>.p<process>.json``: ``{"ok": true}``
or the failure (its traceback). What the job writes for other jobs to read (checkpoints,
safetensors files) goes under ``OUT/files``; ``--peer`` is another job's ``OUT``, whose
files the ``peer_*`` cases read back on this job's processes.

A hang is bounded twice: ``faulthandler.dump_traceback_later`` dumps this process's
stacks to ``OUT/stacks.p<process>.txt`` and exits once a case runs past ``CASE_TIMEOUT_S``
(the other processes dump theirs on the launcher's SIGTERM), and the test that started the
job dumps (SIGUSR1) and kills it after its own bound. The case a process is in is in
``OUT/current.p<process>``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import modelshard as ms

ms.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

CASE_TIMEOUT_S = 45.0  # a case takes seconds on a loaded 2-core machine

# leaves: how each is laid out on the (data=2, model=4) mesh. Under 2 processes x 4
# devices, data row i is process i's devices: "within" is split over one process's
# devices and whole on each process, "span" spans both processes, "local" is a NumPy
# array (the same value on every process) beside one committed to this process's first
# device.
LAYOUTS = {"rep": P(), "within": P(None, "model"), "span": P("data", "model"), "local": None}
SIZES = {"tiny": (16, 8), "big": (512, 1024)}  # 512 B and 2 MiB of float32
# where "local" leaves go when an entry point places them
LOCAL_TARGET = P("data", "model")
OTHER = P("model", "data")  # a layout unlike all of the above: what reshard and constrain make


def value(size: str, salt: int = 0) -> np.ndarray:
    """Every element distinct and exact in float32 (< 2**24)."""
    shape = SIZES[size]
    return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + salt).astype(np.float32)


class Ctx:
    def __init__(self, out: Path, peer: Path | None):
        self.out = out
        self.files = out / "files"
        self.peer = None if peer is None else peer / "files"
        self.me = jax.process_index()
        self.n = jax.process_count()
        self.mesh = ms.make_mesh({"data": 2, "model": 4})


def spec_of(layout: str) -> P:
    s = LAYOUTS[layout]
    return LOCAL_TARGET if s is None else s


def state_of(ctx: Ctx, layout: str, size: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The leaves of one cell of the matrix, and their values."""
    w = value(size)
    if layout == "local":
        v = value(size, 1)
        return {"w": w, "v": jax.device_put(v, jax.local_devices()[0])}, {"w": w, "v": v}
    return ms.shard({"w": w}, LAYOUTS[layout], ctx.mesh), {"w": w}


def check(got: Any, want: dict[str, np.ndarray], specs: dict[str, P] | None = None) -> None:
    """``got``'s leaves equal ``want`` bit for bit (all-gathered where they span processes:
    every process calls this), with ``specs`` where given."""
    host = ms.distributed.to_host(got)
    assert sorted(host) == sorted(want), (sorted(host), sorted(want))
    for k, w in want.items():
        g = np.asarray(host[k])
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, g.shape, w.dtype, w.shape)
        if not np.array_equal(g.view(np.uint8), w.view(np.uint8)):
            bad = np.argwhere(g != w)
            raise AssertionError(f"{k}: {len(bad)} elements differ, first at {bad[0].tolist()}")
        if specs and k in specs:
            s = got[k].sharding
            assert isinstance(s, NamedSharding) and s.spec == specs[k], (k, s, specs[k])


def spec_toml(spec: P) -> str:
    entries = ", ".join('"none"' if e is None else json.dumps(e) for e in spec)
    return f'[[rules]]\npattern = ".*"\nspec = [{entries}]\n'


def cli(*argv: str) -> None:
    rc = ms.cli.main(list(argv))
    assert rc == 0, f"modelshard {' '.join(argv)} exited {rc}"


def agreed(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every process, then every process raises if it failed on any (rather
    than wait at the next barrier for the barrier timeout)."""
    try:
        out, error = fn(), None
    except Exception as e:
        out, error = None, f"{type(e).__name__}: {e}"
    errors = ms.distributed.gather(error, f"journey:{what}")
    failed = [f"process {p}: {e}" for p, e in enumerate(errors) if e is not None]
    if failed:
        raise AssertionError(f"{what} failed on " + "; ".join(failed))
    return out


@contextlib.contextmanager
def compiles() -> Iterator[list[str]]:
    """The name of each program XLA compiles inside the block, from JAX's own events."""
    names: list[str] = []

    def listen(event: str, duration_secs: float, **kw: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(str(kw.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


# ---- the cases ----------------------------------------------------------------------------

CASES: list[tuple[str, Callable[[Ctx], None]]] = []


def case(name: str) -> Callable[[Callable[[Ctx], None]], Callable[[Ctx], None]]:
    def add(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        CASES.append((name, fn))
        return fn

    return add


def cell(name: str) -> Callable[[Callable[[Ctx, str, str], None]], None]:
    """A case per layout and size."""

    def add(fn: Callable[[Ctx, str, str], None]) -> None:
        for layout in LAYOUTS:
            for size in SIZES:
                CASES.append(
                    (f"{name}[{layout}-{size}]", lambda c, f=fn, a=layout, b=size: f(c, a, b))
                )

    return add


@case("step_compiles_once")
def _step_compiles_once(ctx: Ctx) -> None:
    """A step compiled before the process's first save, restore and manager step compiles
    no more after them, nor after Orbax's import (a restore of Orbax's own checkpoint),
    which defined JAX options that are part of every jit cache key: a ``jax.jit`` and a
    ``shard_jit`` step each compiled twice. The first case, so that nothing has imported
    Orbax before it (``setup`` does not)."""
    import collections

    assert "orbax.checkpoint" not in sys.modules, "Orbax was imported before: nothing to see"
    spec = LAYOUTS["span"]
    want = {"w": value("tiny")}
    state = ms.shard(want, spec, ctx.mesh)

    def step(s: dict[str, Any]) -> dict[str, Any]:
        return {"w": s["w"] * 2.0}

    plain = jax.jit(step)
    sharded = ms.shard_jit(step, mesh=ctx.mesh, in_specs=(spec,))
    path = ctx.files / "step_compiles_once"
    with compiles() as names:
        for _ in range(2):
            jax.block_until_ready((plain(state), sharded(state)))
        ms.save(path / "ck", state, overwrite=True)
        restored = ms.restore(path / "ck", like=state)
        with ms.CheckpointManager(path / "root", async_save=True) as mngr:
            mngr.save(1, state)
            mngr.wait_until_finished()
        assert "orbax.checkpoint" not in sys.modules  # none of them imports Orbax now
        import orbax.checkpoint  # noqa: F401  (as a restore of Orbax's own checkpoint does)

        for x in (state, restored):
            out = (plain(x), sharded(x))
            for o in out:
                check(o, {"w": want["w"] * 2.0}, {"w": spec})
    steps = collections.Counter(n for n in names if n == "jit(step)")
    assert steps == {"jit(step)": 2}, f"jax.jit's and shard_jit's step once each: {names}"


@case("issue31_save_hang")
def _issue31(ctx: Ctx) -> None:
    """The reported hang: ms.save of a leaf spanning both processes (issue 31)."""
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    state = ms.shard({"w": w}, P("data", "model"), ctx.mesh)
    path = ctx.files / "issue31"
    ms.save(path, state, overwrite=True)
    check(ms.restore(path, like=state), {"w": w}, {"w": P("data", "model")})


@case("restore_checksum_programs")
def _restore_checksum_programs(ctx: Ctx) -> None:
    """Checksums are summed on the host by programs of a few fixed sizes, compiled once per
    process whatever the leaves' shapes and layouts: a restore after a save compiles none,
    leaves spanning processes included (each process sums its own blocks, the processes
    add their sums through the coordination service: no collective to compile)."""
    import collections

    shapes = {"a": (1024, 1032), "b": (1024, 1032), "c": (1024, 1032), "d": (2048, 1032)}
    spec = LAYOUTS["span"]
    want = {
        k: (np.arange(np.prod(s), dtype=np.float32) % 65521 + i).reshape(s)
        for i, (k, s) in enumerate(shapes.items())
    }
    state = ms.shard(want, spec, ctx.mesh)
    path = ctx.files / "restore_checksum_programs"
    ms.save(path, state, overwrite=True)
    like = {
        k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(ctx.mesh, spec))
        for k, s in shapes.items()
    }
    counts = []
    for _ in range(2):
        with compiles() as names:
            check(ms.restore(path, like=like), want, {k: spec for k in shapes})
        counts.append(collections.Counter(n for n in names if "sums" in n or "check" in n))
    assert counts == [{}, {}], counts


@cell("shard")
def _shard(ctx: Ctx, layout: str, size: str) -> None:
    w = value(size)
    x = jax.device_put(w, jax.local_devices()[0]) if layout == "local" else w
    check(ms.shard({"w": x}, spec_of(layout), ctx.mesh), {"w": w}, {"w": spec_of(layout)})


@cell("shard_jit")
def _shard_jit(ctx: Ctx, layout: str, size: str) -> None:
    w = value(size)
    x = w if layout == "local" else ms.shard(w, LAYOUTS[layout], ctx.mesh)

    def f(s: Any) -> Any:
        return {"a": s["w"] * 2 + 1, "t": s["w"].T}

    step = ms.shard_jit(f, mesh=ctx.mesh, in_specs=(spec_of(layout),))
    check(step({"w": x}), {"a": w * 2 + 1, "t": np.ascontiguousarray(w.T)})


@cell("constrain")
def _constrain(ctx: Ctx, layout: str, size: str) -> None:
    w = value(size)
    if layout == "local":  # eagerly, from NumPy
        check({"w": ms.constrain(w, OTHER, ctx.mesh)}, {"w": w}, {"w": OTHER})
        return
    x = ms.shard(w, LAYOUTS[layout], ctx.mesh)
    out = jax.jit(lambda s: ms.constrain(s * 1, OTHER, ctx.mesh))(x)
    check({"w": out}, {"w": w}, {"w": OTHER})


@cell("shard_map")
def _shard_map(ctx: Ctx, layout: str, size: str) -> None:
    w = value(size)
    spec = spec_of(layout)
    x = w if layout == "local" else ms.shard(w, spec, ctx.mesh)
    axes = tuple(a for a in spec if a is not None)
    # a collective over the axes the leaf is split on: the sum of each block's first element
    f = ms.shard_map(
        lambda a: (a * 2, jax.lax.psum(a[:1, :1], axes) if axes else a[:1, :1]),
        mesh=ctx.mesh,
        in_specs=(spec,),
        out_specs=(spec, P()),
    )
    doubled, total = f(x)
    index = NamedSharding(ctx.mesh, spec).devices_indices_map(w.shape)
    blocks = {tuple((s.start, s.stop) for s in index[d]): index[d] for d in index}
    firsts = sum(w[b][0, 0] for b in blocks.values())
    check({"d": doubled, "s": total}, {"d": w * 2, "s": np.full((1, 1), firsts, np.float32)})


@cell("assemble")
def _assemble(ctx: Ctx, layout: str, size: str) -> None:
    w = value(size)
    spec = LAYOUTS[layout] if layout != "local" else P()
    index = NamedSharding(ctx.mesh, spec).devices_indices_map(w.shape)
    mine = [d for d in ctx.mesh.devices.flat if d.process_index == ctx.me]
    pieces = [{"w": w[index[d]]} for d in mine]
    check(ms.assemble(pieces, spec, ctx.mesh), {"w": w}, {"w": spec})
    rows = ms.distributed.local_slice(w.shape, spec, ctx.mesh)
    check(ms.assemble_process_local({"w": w[rows]}, spec, ctx.mesh), {"w": w}, {"w": spec})


def _saved_specs(layout: str, state: dict[str, Any]) -> dict[str, P]:
    return {} if layout == "local" else {"w": LAYOUTS[layout]}


@cell("save_restore")
def _save_restore(ctx: Ctx, layout: str, size: str) -> None:
    state, want = state_of(ctx, layout, size)
    path = ctx.files / f"save-{layout}-{size}"
    ms.save(path, state, overwrite=True)
    check(ms.restore(path, like=state), want, _saved_specs(layout, state))
    check(ms.restore(path), want)  # no like: as saved
    # Python values beside the arrays: none dropped, with like or without, on every process
    values = {"epoch": 7, "run": f"{layout}-{size}", "lr": 0.5, "done": False}
    other = {"epoch": 0, "run": "", "lr": 0.0, "done": True}
    path = ctx.files / f"save-values-{layout}-{size}"
    ms.save(path, {**state, **values}, overwrite=True)
    for got in (ms.restore(path), ms.restore(path, like={**state, **other})):
        assert {k: (type(got[k]), got[k]) for k in values} == {
            k: (type(v), v) for k, v in values.items()
        }, got
        check({k: got[k] for k in want}, want)


@cell("reshard")
def _reshard(ctx: Ctx, layout: str, size: str) -> None:
    _, want = state_of(ctx, layout, size)
    src = ctx.files / f"save-{layout}-{size}"  # written by save_restore
    dst = ms.reshard(src, ctx.files / f"reshard-{layout}-{size}", specs=OTHER, mesh=ctx.mesh)
    check(ms.restore(dst), want, dict.fromkeys(want, OTHER))


@cell("reshard_cli")
def _reshard_cli(ctx: Ctx, layout: str, size: str) -> None:
    _, want = state_of(ctx, layout, size)
    src = ctx.files / f"save-{layout}-{size}"
    dst = ctx.files / f"reshard_cli-{layout}-{size}"
    rules = ctx.files / "other.toml"
    agreed(f"reshard_cli:{layout}-{size}", lambda: cli(
        "reshard", str(src), str(dst), "--mesh", "data=2,model=4", "--rules", str(rules),
        "--overwrite", "--json"))  # fmt: skip
    check(ms.restore(dst), want, dict.fromkeys(want, OTHER))


@cell("manager")
def _manager(ctx: Ctx, layout: str, size: str) -> None:
    state, want = state_of(ctx, layout, size)
    for how in ("sync", "async"):
        root = ctx.files / f"manager-{how}-{layout}-{size}"
        with ms.CheckpointManager(root, async_save=how == "async") as mngr:
            mngr.save(3, state)
            mngr.wait_until_finished()
            assert mngr.all_steps() == [3], mngr.all_steps()
            check(mngr.restore(like=state), want, _saved_specs(layout, state))
        with ms.CheckpointManager(root) as mngr:  # a new manager of the same root
            check(mngr.restore(3), want)


@cell("manager_preemption")
def _manager_preemption(ctx: Ctx, layout: str, size: str) -> None:
    """A stop request seen at a step every process saves, as a loop polling
    ``should_save`` does after SIGTERM (JAX's preemption sync point under several
    processes, the signal itself in one)."""
    from modelshard._checkpoint import guard

    state, want = state_of(ctx, layout, size)
    root = ctx.files / f"preempt-{layout}-{size}"
    with ms.CheckpointManager(root, save_interval_steps=1000) as mngr:
        try:
            guard.request_stop(signal.SIGTERM)
            saved = [s for s in range(1, 4) if mngr.should_save(s) and mngr.save(s, state)]
        finally:
            guard._stop.clear()
        assert saved == [1, 2, 3], saved  # once stopping, every polled step is a saving step
        assert mngr.all_steps() == [1, 2, 3], mngr.all_steps()
        check(mngr.restore(like=state), want, _saved_specs(layout, state))


@cell("load_safetensors")
def _load_safetensors(ctx: Ctx, layout: str, size: str) -> None:
    want = {"w": value(size, 2)}
    path = ctx.files / f"in-{size}.safetensors"  # written by setup
    if layout == "local":
        got = ms.load_safetensors(path, progress=False)
        check(got, want)
        return
    got = ms.load_safetensors(path, specs=LAYOUTS[layout], mesh=ctx.mesh, progress=False)
    check(got, want, {"w": LAYOUTS[layout]})


@cell("save_safetensors")
def _save_safetensors(ctx: Ctx, layout: str, size: str) -> None:
    from safetensors.numpy import load_file

    state, want = state_of(ctx, layout, size)
    path = ctx.files / f"out-{layout}-{size}.safetensors"
    agreed(
        f"save_safetensors:{layout}-{size}",
        lambda: ms.save_safetensors(path, state, progress=False),
    )
    got = load_file(str(path))
    check(got, want)


@cell("convert")
def _convert(ctx: Ctx, layout: str, size: str) -> None:
    """safetensors -> a checkpoint laid out on the mesh -> safetensors again."""
    from safetensors.numpy import load_file

    want = {"w": value(size, 2)}
    src = ctx.files / f"in-{size}.safetensors"
    ckpt = ctx.files / f"convert-{layout}-{size}"
    spec = spec_of(layout)
    rules = ctx.files / f"{layout}.toml"
    agreed(f"convert:{layout}-{size}", lambda: cli(
        "convert", str(src), str(ckpt), "--mesh", "data=2,model=4", "--rules", str(rules),
        "--overwrite", "--no-progress", "--json"))  # fmt: skip
    check(ms.restore(ckpt), want, {"w": spec})
    back = ctx.files / f"convert-{layout}-{size}.safetensors"
    agreed(f"convert_back:{layout}-{size}", lambda: cli(
        "convert", str(ckpt), str(back), "--to", "safetensors", "--overwrite", "--no-progress"))  # fmt: skip
    check(load_file(str(back)), want)


def _peer_cell(name: str, read: Callable[[Ctx, Path, str, str], tuple[Any, dict]]) -> None:
    def run(ctx: Ctx, layout: str, size: str) -> None:
        assert ctx.peer is not None, "no --peer"
        got, want = read(ctx, ctx.peer, layout, size)
        check(got, want)

    cell(name)(run)


def _peer_value(ctx: Ctx, layout: str, size: str) -> dict[str, np.ndarray]:
    return {"w": value(size)} | ({"v": value(size, 1)} if layout == "local" else {})


_peer_cell(
    "peer_restore",
    lambda c, d, lay, s: (ms.restore(d / f"save-{lay}-{s}"), _peer_value(c, lay, s)),
)
_peer_cell(
    "peer_restore_onto_mesh",
    lambda c, d, lay, s: (
        ms.restore(d / f"save-{lay}-{s}", specs=OTHER, mesh=c.mesh),
        _peer_value(c, lay, s),
    ),
)
_peer_cell(
    "peer_reshard",
    lambda c, d, lay, s: (ms.restore(d / f"reshard-{lay}-{s}"), _peer_value(c, lay, s)),
)


def manager_step(root: Path, step: int) -> Any:
    with ms.CheckpointManager(root) as mngr:
        return mngr.restore(step)


_peer_cell(
    "peer_manager",
    lambda c, d, lay, s: (manager_step(d / f"manager-async-{lay}-{s}", 3), _peer_value(c, lay, s)),
)
_peer_cell(
    "peer_safetensors",
    lambda c, d, lay, s: (
        ms.load_safetensors(d / f"out-{lay}-{s}.safetensors", progress=False),
        _peer_value(c, lay, s),
    ),
)


@case("manager_ctrl_c_on_one_process")
def _ctrl_c(ctx: Ctx) -> None:
    """SIGINT reaches one process of a loop that polls ``should_save``: every process saves
    the same step (a signal reaches each process at its own moment: the stop must be
    agreed, or one process saves alone and waits for the others). Last: JAX's preemption
    service, once it has stopped a run, does not start over."""
    from modelshard._checkpoint import guard

    state, want = state_of(ctx, "span", "tiny")
    saved = []
    with ms.CheckpointManager(ctx.files / "ctrl_c", save_interval_steps=1000) as mngr:
        try:
            for step in range(1, 200):
                if mngr.should_save(step):
                    mngr.save(step, state)
                    saved.append(step)
                    break
                if step == 3 and ctx.me == ctx.n - 1:
                    os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
        finally:
            guard._stop.clear()  # the worker goes on: not a stopping process any more
        everyone = ms.distributed.gather(saved, "journey:ctrl_c")
        assert len(saved) == 1 and all(s == saved for s in everyone), everyone
        assert mngr.all_steps() == saved, (mngr.all_steps(), saved)
        check(mngr.restore(like=state), want, {"w": LAYOUTS["span"]})


def setup(ctx: Ctx) -> None:
    """Inputs every process reads: written by process 0 alone (plain files, no collective)."""
    from safetensors.numpy import save_file

    if ctx.me == 0:
        ctx.files.mkdir(parents=True, exist_ok=True)
        for size in SIZES:
            save_file({"w": value(size, 2)}, str(ctx.files / f"in-{size}.safetensors"))
        (ctx.files / "other.toml").write_text(spec_toml(OTHER))
        for layout in LAYOUTS:
            (ctx.files / f"{layout}.toml").write_text(spec_toml(spec_of(layout)))
    ms.distributed.barrier("journey:setup")


# ---- the loop -----------------------------------------------------------------------------


PEER_WAIT_S = 300.0  # the other job runs side by side; the test's stall bound is the real one


def _wait_for_peer(done: Path) -> None:
    """The other job's files are complete once it wrote ``done``."""
    t0 = time.monotonic()
    while not done.exists():
        if time.monotonic() - t0 > PEER_WAIT_S:
            raise SystemExit(f"the peer job did not finish within {PEER_WAIT_S:g} s ({done})")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--peer", type=Path)
    ap.add_argument("--only", nargs="*", help="names (or prefixes) of the cases to run")
    args = ap.parse_args()
    ctx = Ctx(args.out, args.peer)
    results = args.out / "results"
    results.mkdir(parents=True, exist_ok=True)
    stacks = open(args.out / f"stacks.p{ctx.me}.txt", "w")  # noqa: SIM115 - open until exit
    # the test that started the job asks for every process's stacks with SIGUSR1; the
    # launcher stops the others with SIGTERM when one process's case timer ends it
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    (args.out / f"pid.p{ctx.me}").write_text(str(os.getpid()))
    current = args.out / f"current.p{ctx.me}"
    setup(ctx)
    chosen = [
        (name, fn)
        for name, fn in CASES
        if (ctx.peer is not None or not name.startswith("peer_"))
        and (not args.only or any(name.startswith(o) for o in args.only))
    ]
    for name, fn in chosen:
        if name.startswith("peer_") and ctx.peer is not None:
            _wait_for_peer(ctx.peer.parent / "done")
        current.write_text(name)
        stacks.write(f"\n--- case {name}\n")
        stacks.flush()
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True, file=stacks)
        t0 = time.perf_counter()
        try:
            # Long enough for a process that failed fast to wait for one still in a
            # barrier of the case before (which gives up after the barrier timeout).
            ms.distributed.barrier(
                f"journey:{name}:start", timeout_s=2 * ms.distributed.barrier_timeout_s() + 5
            )
            fn(ctx)
            out: dict[str, Any] = {"ok": True}
        except Exception as e:  # the case failed here: record it, go on with the next
            out = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(),
            }
        out["seconds"] = time.perf_counter() - t0
        faulthandler.cancel_dump_traceback_later()
        (results / f"{name}.p{ctx.me}.json").write_text(json.dumps(out))
    current.write_text("")
    ms.distributed.barrier("journey:done")
    if ctx.me == 0:
        (args.out / "done").write_text("")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
