"""Container adapters: the registry and the built-in adapters (public module)."""

from ._adapters import Adapter as Adapter
from ._adapters import CallLeaves as CallLeaves
from ._adapters import NnxModuleAdapter as NnxModuleAdapter
from ._adapters import PytreeAdapter as PytreeAdapter
from ._adapters import get_adapter as get_adapter
from ._adapters import register_container as register_container
from ._adapters import registered as registered
from ._adapters import registry_snapshot as registry_snapshot
from ._describe import LeafInfo as LeafInfo
from ._describe import is_array as is_array
from ._flat import Flat as Flat
from ._flat import split as split
from ._paths import format_path as format_path

# The third-party adapters register themselves (lazily: nothing of penzai or qwix is
# imported until the user imports it) when their modules load, here.
from ._penzai import NamedArrayAdapter as NamedArrayAdapter
from ._penzai import PenzaiVariableAdapter as PenzaiVariableAdapter
from ._qwix import QwixWithAuxAdapter as QwixWithAuxAdapter
