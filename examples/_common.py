"""Shared by the examples: text that ships with Python, batches of it, a training loop with a
progress bar, and byte counts for people. Nothing here is modelshard-specific."""

from __future__ import annotations

import codecs
import contextlib
import inspect
import io
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

console = Console(width=max(Console().width, 130))

VOCAB = 128  # ASCII: one token per character


def encode(text: str) -> np.ndarray:
    """Characters as token ids in ``[0, 128)``."""
    return np.frombuffer(text.encode("ascii", "replace"), np.uint8).astype(np.int32) % VOCAB


def pretrain_text() -> str:
    """The source code of a standard-library module (about 20 KB of English and Python)."""
    return inspect.getsource(textwrap)


def finetune_text() -> str:
    """The Zen of Python, from the ``this`` module (which prints it when imported)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def batches(text: str, batch: int, seq: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless random windows ``(inputs, targets)`` of ``seq`` characters."""
    tokens = encode(text)
    rng = np.random.default_rng(seed)
    while True:
        start = rng.integers(0, len(tokens) - seq - 1, batch)
        window = np.stack([tokens[s : s + seq + 1] for s in start])
        yield window[:, :-1], window[:, 1:]


def train(
    step: Callable[..., tuple[Any, Any]],
    state: Any,
    data: Iterator[tuple[np.ndarray, np.ndarray]],
    steps: int,
    title: str,
) -> tuple[Any, list[float]]:
    """Run ``state, loss = step(state, inputs, targets)`` with a progress bar showing the loss."""
    losses: list[float] = []
    with Progress(
        TextColumn(f"[bold]{title}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss [cyan]{task.fields[loss]}"),
        console=console,
    ) as bar:
        task = bar.add_task(title, total=steps, loss="-")
        for _ in range(steps):
            inputs, targets = next(data)
            state, loss = step(state, inputs, targets)
            losses.append(float(loss))
            bar.update(task, advance=1, loss=f"{losses[-1]:.3f}")
    k = max(1, len(losses) // 10)
    console.print(
        f"{title}: loss {np.mean(losses[:k]):.3f} -> {np.mean(losses[-k:]):.3f} "
        f"(mean of the first and last {k} steps)"
    )
    return state, losses


def human(n: float) -> str:
    """``1.29 MiB``-style text for a byte count."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
