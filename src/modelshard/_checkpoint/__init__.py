"""The checkpoint area's façade: ``save``, ``restore``, ``reshard``, ``CheckpointManager`` and
what the CLI needs to look inside a checkpoint without reading its arrays.

On disk a checkpoint is a plain Orbax PyTree checkpoint (OCDBT, each process writing its
own shards) of a nested dict keyed by the components of each leaf's canonical path, plus
the JSON record (``.record``). ``orbax.checkpoint.StandardCheckpointer`` restores it
without modelshard; typed PRNG keys are stored as their key data. README.md beside this
module gives the call path and the format; ``.storage`` owns every name on disk.
"""

from __future__ import annotations

from .items import extras_json as extras_json
from .items import read_items as read_items
from .items import read_metadata as read_metadata
from .listing import checkpoint_kind as checkpoint_kind
from .listing import list_steps as list_steps
from .listing import manager_step as manager_step
from .manager import CheckpointManager as CheckpointManager
from .mapped import host_leaves as host_leaves
from .record import Record as Record
from .resharding import reshard as reshard
from .resharding import step_extras as step_extras
from .restoring import restore as restore
from .slabs import StreamLeaf as StreamLeaf
from .sources import Source as Source
from .sources import locate as locate
from .sources import planning_tree as planning_tree
from .stream import write_stream as write_stream
from .urls import check_bucket as check_bucket
from .urls import is_remote as is_remote
from .urls import location as location
from .urls import reaching as reaching
from .write import prepare as prepare
from .write import save as save
