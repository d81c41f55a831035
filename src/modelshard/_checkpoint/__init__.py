"""The checkpoint area's façade: ``save``, ``restore``, ``CheckpointManager`` and what the CLI
needs to look inside a checkpoint without reading its arrays. (``reshard`` is imported from
``.reshard`` itself: exported here, the function would hide its module.)

On disk a checkpoint is a plain Orbax PyTree checkpoint (OCDBT, each process writing its
own shards) of a nested dict keyed by the components of each leaf's canonical path, plus
the JSON record (``.record``). ``orbax.checkpoint.StandardCheckpointer`` restores it
without modelshard; typed PRNG keys are stored as their key data. README.md beside this
module gives the call path and the format; ``.storage`` owns every name on disk.

The submodule ``locate`` shares its name with the function exported here: reach the
module with ``importlib.import_module("modelshard._checkpoint.locate")``.
"""

from __future__ import annotations

from .items import extras_json as extras_json
from .items import read_items as read_items
from .items import read_metadata as read_metadata
from .locate import Source as Source
from .locate import locate as locate
from .locate import planning_tree as planning_tree
from .manager import CheckpointManager as CheckpointManager
from .manager import manager_step as manager_step
from .record import Record as Record
from .restoring import restore as restore
from .write import prepare as prepare
from .write import save as save
