"""``fit_advice``: the smallest change that makes a step fit a budget, each compiled."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from .._base import FitError, Problem, format_bytes, format_mesh, format_spec, vocabulary
from .._place import parse_bytes
from .._specs import Rules
from .candidates import KINDS, BatchInfo, Change, batch_change, cast_outputs, changes_for
from .memory import Compiler, StepMemory, check_names, compiler, largest
from .rulegen import norm_spec, rules_for


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One change checked by compiling the step with it.

    Attributes:
        kind: one of ``KINDS`` (``"+"``-joined for a combination).
        description: the change in words.
        memory: the [`StepMemory`][modelshard.StepMemory] of the step with the change.
        saves: bytes per device saved against the step as given.
        fits: whether ``memory.total`` is within the budget.
        in_specs: the ``in_specs`` to compile the step with.
        rules: argument name -> [`Rules`][modelshard.Rules] for every argument whose
            placement changed (``rules.to_toml()`` is a rules file).
        args: the abstract arguments compiled (a smaller batch, narrower moments).
        donate_argnums: the donated arguments.
        step: the function compiled (the rematerialised step for ``remat``).
        code: what to paste: Python for the change.
        error: why the candidate could not be compiled (then ``memory`` is None).
        notes: the changes that are not placement, as in ``code``.
    """

    kind: str
    description: str
    memory: StepMemory | None
    saves: int
    fits: bool
    in_specs: Any = dataclasses.field(repr=False)
    rules: dict[str, Rules] = dataclasses.field(repr=False)
    args: tuple[Any, ...] = dataclasses.field(repr=False)
    donate_argnums: tuple[int, ...] = dataclasses.field(repr=False)
    step: Callable[..., Any] = dataclasses.field(repr=False)
    code: str = ""
    error: str | None = None
    notes: tuple[str, ...] = ()

    def pasteable(self) -> str:
        """``code``; on the command line, each changed argument's rules as a rules file."""
        if vocabulary() != "cli" or not self.rules:
            return self.code
        files = [f"# rules file for {name}\n{r.to_toml()}" for name, r in self.rules.items()]
        return "\n".join([*files, *self.notes]).rstrip()

    def toml(self, arg: str | None = None) -> str | None:
        """The rules file for argument ``arg`` (default: the only one that changed)."""
        if not self.rules:
            return None
        return self.rules[next(iter(self.rules)) if arg is None else arg].to_toml()

    def to_json(self) -> dict[str, Any]:
        m = self.memory
        return {
            "kind": self.kind,
            "description": self.description,
            "fits": self.fits,
            "saves": self.saves,
            "total": None if m is None else m.total,
            "compile_seconds": None if m is None else round(m.compile_seconds, 3),
            "code": self.code,
            "rules": {name: r.to_toml() for name, r in self.rules.items()},
            "error": self.error,
        }


@dataclasses.dataclass(frozen=True)
class FitAdvice:
    """Whether a step fits a per-device budget, and the changes that make it fit.

    Attributes:
        budget: bytes per device.
        memory: the step as given ([`StepMemory`][modelshard.StepMemory]).
        fits: whether it fits as given (then no suggestion is made).
        suggestions: every candidate checked, in the order tried, with its bytes.
        best: the least invasive suggestion that fits (``KINDS`` order); None when the
            step fits or nothing tried does.
        compiles: how many compiles the advice took.
        compile_seconds: their total time.
    """

    budget: int
    memory: StepMemory
    fits: bool
    suggestions: list[Suggestion]
    best: Suggestion | None
    compiles: int
    compile_seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "fits": self.fits,
            "memory": self.memory.to_json(),
            "best": None if self.best is None else self.best.to_json(),
            "suggestions": [s.to_json() for s in self.suggestions],
            "compiles": self.compiles,
            "compile_seconds": round(self.compile_seconds, 3),
        }

    def check(self) -> None:
        """Raise if the step as given does not fit the budget.

        Raises:
            FitError: naming the step's bytes, the budget and the smallest change that fits.
        """
        if self.fits:
            return
        m, best = self.memory, self.best
        hint = "no change tried fits: shard over a larger mesh, or train a smaller model"
        if best is not None:
            hint = best.description
        if best is not None and best.memory is not None:
            hint = f"the smallest change that fits ({format_bytes(best.memory.total)} per "
            hint += f"device, checked by compiling): {best.description}"
        what = f"the step needs {format_bytes(m.total)} per device > budget "
        what += f"{format_bytes(self.budget)} (largest: {largest(m)})"
        cause = "bytes per device > budget"
        raise FitError(
            # ``path`` None: the whole step, no single leaf
            [Problem("budget", None, what, mesh=m.mesh, hint=hint, cause=cause)],
            self,
            header="the step does not fit the memory budget:",
        )

    def lines(self) -> list[str]:
        """The verdict, each change checked with its bytes, and the smallest that fits."""
        m = self.memory
        verdict = "fits" if self.fits else "does not fit"
        out = [
            f"{format_bytes(m.total)} per device on mesh ({format_mesh(m.mesh)}) {verdict} "
            f"the budget of {format_bytes(self.budget)}"
        ]
        if self.suggestions:
            out.append(
                f"checked {len(self.suggestions)} changes ({self.compiles} compiles, "
                f"{self.compile_seconds:.1f}s):"
            )
        for s in self.suggestions:
            if s.memory is None:
                out.append(f"  {s.description}: not compiled ({s.error})")
                continue
            mark = "fits" if s.fits else "too big"
            out.append(
                f"  {s.description}: {format_bytes(s.memory.total)} "
                f"(saves {format_bytes(s.saves)}), {mark}"
            )
        if self.best is not None:
            out += ["smallest change that fits: " + self.best.description, self.best.pasteable()]
        elif not self.fits:
            out.append("no change tried fits: shard over a larger mesh, or a smaller model")
        return out

    def __str__(self) -> str:
        return "\n".join([str(self.memory), *self.lines()])


def fit_advice(
    step: Callable[..., Any],
    *args: Any,
    budget: int | float | str,
    mesh: Any = None,
    in_specs: Any = None,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    batch_argnums: int | Sequence[int] | None = None,
    roles: Mapping[str, str | re.Pattern[str]] | None = None,
    remat: Callable[..., Any] | None = None,
    kinds: Sequence[str] = KINDS,
    first: bool = False,
    topology: str | None = None,
    **kwargs: Any,
) -> FitAdvice:
    """Whether ``step`` fits ``budget`` bytes per device, and the smallest change that does.

    The step is compiled as given ([`step_memory`][modelshard.step_memory]); if it does not
    fit, each candidate change is compiled once more from abstract arguments: donation,
    ZeRO-1, bfloat16 moments, FSDP, tensor parallelism by parameter name, remat, and halving
    the batch. Changes that saved memory are combined, largest first, when none fits alone;
    the batch is cut last. Placement changes come as [`Rules`][modelshard.Rules], ready to
    paste.

    Args:
        step: the training step (a function or a ``ShardJit``).
        *args: its arguments, abstract (``jax.ShapeDtypeStruct`` leaves).
        budget: bytes per device, or text such as ``"16GiB"``.
        mesh, in_specs, donate_argnums, static_argnums, batch_argnums, roles, topology,
            **kwargs: as for [`step_memory`][modelshard.step_memory].
        remat: the same step with rematerialisation, to check as a candidate.
        kinds: which kinds of change to try (``KINDS``).
        first: stop at the first change that fits (fewer compiles).

    Returns:
        A [`FitAdvice`][modelshard.FitAdvice].

    Raises:
        SpecError: a spec that cannot be placed, an unknown role or kind, a bad budget.
        MeshError: a mesh larger than the devices JAX can compile for.
    """
    limit = parse_bytes(budget)
    check_names("kind", kinds, KINDS, "kind of change")
    batch, static, donate = batch_argnums, static_argnums, donate_argnums
    c = compiler(step, args, kwargs, mesh, in_specs, donate, static, batch, roles, topology)
    base = c.measure()
    if base.total <= limit:
        return FitAdvice(limit, base, True, [], None, 1, base.compile_seconds)

    plan = base.plan
    leaf_roles = [r for _, r in base.roles]
    changes = changes_for(c, base, remat, kinds)
    tried: list[Suggestion] = []

    def attempt(stack: list[Change]) -> Suggestion:
        fn, call, donate = c.fn, list(c.args), c.donated
        specs = [leaf.spec for leaf in plan.leaves]
        for ch in stack:
            if ch.specs is not None:  # one spec per leaf, in plan order
                specs = list(map(ch.specs, plan.leaves, specs, leaf_roles))
            if ch.args is not None:
                call = ch.args(call)
            if ch.step is not None:
                fn = ch.step
            if ch.donate is not None:
                donate = ch.donate
        for ch in stack:  # outputs narrowed last, around whichever step
            if ch.kind == "moments_dtype":
                fn = cast_outputs(fn, set(ch.narrowed), jax.numpy.bfloat16)
        new_specs, rules = _in_specs(c, plan, specs)
        notes = tuple(ch.code for ch in stack if ch.specs is None and ch.code)
        unmeasured = Suggestion(
            kind="+".join(ch.kind for ch in stack),
            description="; ".join(ch.description for ch in stack),
            memory=None,
            saves=0,
            fits=False,
            in_specs=new_specs,
            rules=rules,
            args=tuple(call),
            donate_argnums=donate,
            step=fn,
            code="\n".join([*map(_python, rules.items()), *notes]),
            notes=notes,
        )
        try:
            mem = c.measure(fn, new_specs, call, donate)
        except Exception as e:  # a candidate the step cannot take is reported, not raised
            return dataclasses.replace(unmeasured, error=f"{type(e).__name__}: {e}")
        fits, saves = mem.total <= limit, base.total - mem.total
        return dataclasses.replace(unmeasured, memory=mem, saves=saves, fits=fits)

    best = None
    for ch in changes:
        if ch.kind != "batch":
            tried.append(s := attempt([ch]))
            if s.fits and best is None:
                best = s
                if first:
                    break
    halve = next((ch.batch for ch in changes if ch.batch is not None), None)
    if best is None:  # combine what saved, largest saving first; the batch is cut last
        saved = [s for s in tried if s.memory is not None and s.saves > 0 and "+" not in s.kind]
        stack: list[Change] = []
        for s in sorted(saved, key=lambda s: -s.saves):
            ch = next(ch for ch in changes if ch.description == s.description)
            # FSDP over an axis already holds the optimizer state there
            if ch.kind == "shard_optimizer" and any(c.kind == "fsdp" for c in stack):
                continue
            stack.append(ch)
            if len(stack) > 1:
                tried.append(combo := attempt(stack))
                if combo.fits:
                    best = combo
                    break
        if best is None and halve is not None:  # the largest batch, all else applied
            best = _halve_until_fits(attempt, halve, tried, stack)
    measured = [s.memory for s in tried if s.memory is not None]
    seconds = base.compile_seconds + sum(m.compile_seconds for m in measured)
    return FitAdvice(limit, base, False, tried, best, 1 + len(measured), seconds)


def _halve_until_fits(
    attempt: Callable[[list[Change]], Suggestion],
    batch: BatchInfo,
    tried: list[Suggestion],
    stack: list[Change],
) -> Suggestion | None:
    """Halve the batch (with ``stack`` applied) until the step fits: the largest batch."""
    k = 1
    while (ch := batch_change(batch, k)) is not None:
        tried.append(s := attempt([*stack, ch]))
        if s.fits or s.memory is None:
            return s if s.fits else None
        k += 1
    return None


def _in_specs(c: Compiler, plan: Any, specs: list[PartitionSpec]) -> tuple[Any, dict[str, Rules]]:
    """The step's ``in_specs`` with each argument whose leaves' specs changed given as rules."""
    rules: dict[str, Rules] = {}
    new = dict(c.in_specs) if isinstance(c.in_specs, Mapping) else list(c.in_specs)
    at = 0
    for i, a in enumerate(plan.args):
        mine = specs[at : at + len(a.leaves)]
        at += len(a.leaves)
        if list(map(norm_spec, mine)) == [norm_spec(leaf.spec) for leaf in a.leaves]:
            continue
        r = rules_for([leaf.path for leaf in a.leaves], mine, [leaf.shape for leaf in a.leaves])
        rules[a.name] = r
        if isinstance(new, dict):
            new[a.name] = r
        else:
            new[c.dynamic[i]] = r
    return (new if isinstance(new, dict) else tuple(new)), rules


def _python(named: tuple[str, Rules]) -> str:
    """One argument's new rules as Python to paste: ``state_rules = ms.Rules([...])``."""
    body = "".join(f"\n    ({p!r}, {format_spec(s)})," for p, s in named[1].rules)
    return f"{named[0]}_rules = ms.Rules([{body}\n])"
