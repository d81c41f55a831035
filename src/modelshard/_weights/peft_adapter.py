"""LoRA adapters out as a peft adapter directory (``save_peft_adapter`` says how)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._base import MappingError, Problem, write_durable
from .._runtime import raise_shared
from . import hub
from .export import write_safetensors
from .inverse import reference_table
from .load import MappingLike, as_mapping, target_table
from .model_dir import reference_directory
from .multiprocess_writing import host_leaf
from .resolver import resolve

_A, _B = "/lora/lora_a", "/lora/lora_b"


def save_peft_adapter(
    directory: str | os.PathLike[str],
    state: Any,
    *,
    reference: Any,
    mapping: MappingLike,
    alpha: float | None = None,
    base_model: str | None = None,
) -> Path:
    """Write the LoRA adapters of ``state`` as a peft adapter directory.

    Each adapter ``P/lora/lora_a`` ([in, rank]) and ``P/lora/lora_b`` ([rank, out]) beside
    a ``P/kernel`` (flax's ``nnx.LoRALinear`` layout; an einsum kernel's adapter works on
    its flattened input and output axes, in the stored weight's order) is written under
    the name of the stored weight that ``mapping`` imports into ``P/kernel``:
    ``base_model.model.<module>.lora_A.weight`` ``[rank, in]`` and ``lora_B.weight``
    ``[out, rank]``. Base weights are not written (export them with
    [`save_safetensors`][modelshard.save_safetensors], or merge the adapters into them).

    Args:
        directory: where ``adapter_model.safetensors`` and ``adapter_config.json`` go.
        state: the fine-tuned container (an NNX model) holding the adapters.
        reference: the base checkpoint (file, index, directory or ``hf://``): its tensor
            names say what each adapter attaches to.
        mapping: the mapping that imports ``reference`` into ``state`` (``"llama"``).
        alpha: peft's ``lora_alpha`` (its scaling is ``alpha / rank``; the written
            ``lora_B`` is divided by it, so any value gives the same outputs). Default:
            the rank (scaling 1).
        base_model: ``base_model_name_or_path`` of the config (default: the reference
            when it is a ``hf://`` id, without the scheme).

    Returns:
        The directory.

    Raises:
        MappingError: no adapter in ``state``; an adapter whose module has no kernel, or
            whose kernel is not one stored ``[out, in]`` weight of matching size; adapters
            of different ranks.
    """
    flat, targets = target_table(state)
    values = dict(zip(flat.paths, flat.arrays, strict=True))
    modules = sorted(p[: -len(_A)] for p in targets if p.endswith(_A))
    table, _, sizes = reference_table(reference)
    wm = as_mapping(mapping, split_dots=True).with_config(sizes)
    recipes = resolve(wm, table, None).recipes
    problems: list[Problem] = []

    def bad(path: str, what: str, hint: str | None = None) -> None:
        problems.append(Problem("state", path, what, hint=hint))

    if not modules:
        bad(
            "",
            "no LoRA adapter (a P/lora/lora_a leaf beside P/kernel)",
            hint="add adapters as nnx.LoRALinear does: module.lora = nnx.LoRA(...)",
        )
    tensors: dict[str, np.ndarray] = {}
    names: list[str] = []
    ranks: set[int] = set()
    for p in modules:
        node = recipes.get(p + "/kernel")
        read = sorted(set(node.reads())) if node is not None else []
        if len(read) != 1 or not read[0].endswith(".weight") or len(table[read[0]][0]) != 2:
            bad(
                p + _A,
                f"its module's kernel {p}/kernel is not mapped from one stored [out, in] weight",
                hint="adapters attach to linear weights the mapping imports",
            )
            continue
        (out_dim, in_dim), _ = table[read[0]]
        a, b = host_leaf(values[p + _A]), host_leaf(values[p + _B])
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1)
        if a.shape[0] != in_dim or b.shape[1] != out_dim or a.shape[1] != b.shape[0]:
            bad(
                p + "/lora",
                f"lora_a {list(a.shape)} and lora_b {list(b.shape)} do not adapt "
                f"{read[0]} [{out_dim}, {in_dim}] (want [{in_dim}, rank], [rank, {out_dim}])",
            )
            continue
        rank = a.shape[1]
        ranks.add(rank)
        module = read[0].removesuffix(".weight")
        names.append(module)
        scale = np.asarray((alpha if alpha is not None else rank) / rank, b.dtype)
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b.T / scale)
    if len(ranks) > 1:
        bad("", f"adapters of ranks {sorted(ranks)}; a peft adapter has one")
    if problems:
        raise MappingError(problems, header="cannot write a peft adapter:")
    rank = ranks.pop()
    lora_alpha = alpha if alpha is not None else rank
    hub_id = reference.removeprefix(hub.PREFIX) if hub.is_hub(reference) else None
    source = reference_directory(reference)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or hub_id or (source and str(source)),
        "r": rank,
        "lora_alpha": int(lora_alpha) if float(lora_alpha).is_integer() else lora_alpha,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in names}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    out = Path(directory)
    failure: Exception | None = None
    if jax.process_index() == 0:  # plain files: every value was computed by every process
        try:
            _write_adapter(out, tensors, config)
        except Exception as e:
            failure = e
    # every process returns once the files are there, or raises process 0's error
    raise_shared(failure, "modelshard:peft:written", f"writing the peft adapter {out}")
    return out


def _write_adapter(out: Path, tensors: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """``adapter_model.safetensors`` and ``adapter_config.json``: local writes, no collective."""
    items = [(k, v.shape, v.dtype) for k, v in tensors.items()]
    meta = {"format": "pt"}
    write_safetensors(out / "adapter_model.safetensors", items, tensors.__getitem__, meta)
    write_durable(out / "adapter_config.json", json.dumps(config, indent=2) + "\n")
