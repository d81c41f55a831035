"""The ``modelshard`` command line, one module per command (see README.md beside this file)."""

from __future__ import annotations

from .program import main as main
from .program import parser as parser
