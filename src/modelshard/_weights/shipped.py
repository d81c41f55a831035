"""The mappings in ``mappings/*.toml``, by name, as ``mappings/shipped.toml`` lists them."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

_DIR = Path(__file__).parent / "mappings"
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class ShippedMapping:
    """One mapping shipped with modelshard.

    Attributes:
        name: what ``mapping=`` takes (``"llama"``).
        source: the checkpoints it reads (Hugging Face classes and models).
        target: the parameter tree it maps them onto.
        path: the TOML file.
    """

    name: str
    source: str
    target: str
    path: Path


def shipped_mappings() -> dict[str, ShippedMapping]:
    """The mappings shipped with modelshard, by name: what each reads and what it maps onto.

    Any of the names is taken where a mapping file's path is (``load_safetensors(...,
    mapping="llama")``, ``save_safetensors``, ``restore(mapping=...)``,
    ``modelshard convert --mapping llama``); ``modelshard mappings`` prints the same list.

    Returns:
        name -> [`ShippedMapping`][modelshard.ShippedMapping], in a stable order.

    Example:
        >>> import modelshard as ms
        >>> sorted(ms.shipped_mappings())[:3]
        ['gemma3', 'gemma3_checkpoint', 'llama']
        >>> ms.shipped_mappings()["qwen2"].path.name
        'qwen2.toml'
    """
    listed = tomllib.loads((_DIR / "shipped.toml").read_text(encoding="utf-8"))
    return {
        name: ShippedMapping(name, about["source"], about["target"], _DIR / f"{name}.toml")
        for name, about in listed.items()
    }


def is_name(text: str) -> bool:
    """``text`` reads as a mapping's name (``llama``), not a path (``hf_llama.toml``)."""
    return _NAME.fullmatch(text) is not None
