"""The mappings in ``mappings/*.toml``, found by name (``mapping="llama"``): what each
reads and the tree it maps onto."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

_DIR = Path(__file__).parent / "mappings"
_NAME = re.compile(r"[a-z][a-z0-9_]*")

_LLAMA_TREE = (
    "NNX Llama layout of examples/llama_weights.py: embed/embedding, "
    "layers/N/attn/{q,k,v,o}/kernel (nnx.Einsum), layers/N/mlp/{gate_up,down}/kernel, "
    "layers/N/{input,post_attention}_norm/scale, norm/scale, head/kernel"
)


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


_SHIPPED = {
    "llama": (
        "Hugging Face LlamaForCausalLM: Llama 2, 3, 3.1, 3.2 (tied: no head leaf)",
        _LLAMA_TREE,
    ),
    "mistral": ("Hugging Face MistralForCausalLM (Llama's names)", _LLAMA_TREE),
    "qwen2": (
        "Hugging Face Qwen2ForCausalLM: Qwen2, Qwen2.5 (q/k/v biases; small ones tied)",
        _LLAMA_TREE + ", layers/N/attn/{q,k,v}/bias [heads, head_dim]",
    ),
    "qwen3": (
        "Hugging Face Qwen3ForCausalLM: dense Qwen3 (q/k norms; small ones tied)",
        _LLAMA_TREE + ", layers/N/attn/{q,k}_norm/scale [head_dim]",
    ),
    "gemma3": (
        "Hugging Face Gemma3ForCausalLM, and Gemma3ForConditionalGeneration's language model",
        "the gemma package's model tree (model.init(...)['params'] of gm.nn.Gemma3_*, what "
        "model.apply runs on): embedder/input_embedding, layer_N/attn/..., "
        "layer_N/mlp/{gating_einsum,linear}, final_norm/scale",
    ),
    "gemma3_checkpoint": (
        "Hugging Face Gemma3ForCausalLM, and Gemma3ForConditionalGeneration's language model",
        "Google's official Gemma 3 checkpoint layout on disk (gm.ckpts' legacy flat "
        "layout): transformer/layer_N/..., mlp/gating_einsum/w, mlp/linear/w",
    ),
}


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
    return {
        name: ShippedMapping(name, source, target, _DIR / f"{name}.toml")
        for name, (source, target) in _SHIPPED.items()
    }


def is_name(text: str) -> bool:
    """``text`` reads as a mapping's name (``llama``), not a path (``hf_llama.toml``)."""
    return _NAME.fullmatch(text) is not None
