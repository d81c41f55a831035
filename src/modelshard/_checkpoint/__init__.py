"""``save`` and ``restore``: sharded Orbax checkpoints of any container, restored onto any mesh.

On disk a checkpoint is a plain Orbax PyTree checkpoint (OCDBT, each process writing its
own shards) of a nested dict keyed by the components of each leaf's canonical path, plus
``modelshard.json`` (see :mod:`modelshard._record`). ``orbax.checkpoint.StandardCheckpointer``
restores it without modelshard; typed PRNG keys are stored as their key data.

The work is split by direction: :mod:`modelshard._checkpoint_write` (``save``, atomic
staging), :mod:`modelshard._checkpoint_locate` (finding a checkpoint and its record) and
:mod:`modelshard._checkpoint_read` (``restore``). This module gathers their entry points.
"""

from __future__ import annotations

from .locate import Source as Source
from .locate import locate as locate
from .locate import planning_tree as planning_tree
from .manager import CheckpointManager as CheckpointManager
from .read import _saved_specs as _saved_specs
from .read import restore as restore
from .write import MARKER as MARKER
from .write import RECORD_ITEM as RECORD_ITEM
from .write import STATE_ITEM as STATE_ITEM
from .write import prepare as prepare
from .write import save as save

__all__ = ["Source", "locate", "prepare", "restore", "save"]
