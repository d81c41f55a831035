"""Container adapters: the registry and the built-in adapters (public module)."""

from ._base import format_path as format_path
from ._containers import Adapter as Adapter
from ._containers import CallLeaves as CallLeaves
from ._containers import Flat as Flat
from ._containers import LeafInfo as LeafInfo
from ._containers import NamedArrayAdapter as NamedArrayAdapter
from ._containers import NnxModuleAdapter as NnxModuleAdapter
from ._containers import PenzaiVariableAdapter as PenzaiVariableAdapter
from ._containers import PytreeAdapter as PytreeAdapter
from ._containers import QwixWithAuxAdapter as QwixWithAuxAdapter
from ._containers import get_adapter as get_adapter
from ._containers import is_array as is_array
from ._containers import register_container as register_container
from ._containers import registered as registered
from ._containers import registry_snapshot as registry_snapshot
from ._containers import split as split
