"""Griffe extension: render Google-style ``Example:`` sections as doctest examples.

Griffe's Google parser treats ``Examples:`` as an examples section (``>>>`` lines become
highlighted code) but the singular ``Example:`` as an admonition, where ``>>>`` lines become
nested block quotes. modelshard's docstrings say ``Example:``; rename it when loading.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        doc = obj.docstring
        if doc is not None and "Example:" in doc.value:
            doc.value = _EXAMPLE.sub(r"\1Examples:", doc.value)
