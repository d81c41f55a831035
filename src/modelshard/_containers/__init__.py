"""The containers area's façade: the adapter registry, the adapters, ``split`` -> ``Flat``."""

from .adapter_base import Adapter as Adapter
from .adapter_base import Again as Again
from .adapter_base import CallLeaves as CallLeaves
from .adapter_base import WriteBack as WriteBack
from .describe import ARRAY_TYPES as ARRAY_TYPES
from .describe import NUMBER_TYPES as NUMBER_TYPES
from .describe import LeafInfo as LeafInfo
from .describe import is_array as is_array
from .describe import numbers_to_arrays as numbers_to_arrays
from .flat import Flat as Flat
from .flat import split as split
from .nested import flatten_nested as flatten_nested
from .nested import holds_nested as holds_nested
from .nested import nested_adapter as nested_adapter
from .nnx import NnxModuleAdapter as NnxModuleAdapter
from .penzai import NamedArrayAdapter as NamedArrayAdapter
from .penzai import PenzaiVariableAdapter as PenzaiVariableAdapter
from .pytree import PytreeAdapter as PytreeAdapter
from .qwix import QwixWithAuxAdapter as QwixWithAuxAdapter
from .registry import REGISTRY as REGISTRY
from .registry import get_adapter as get_adapter
from .registry import optax_kind as optax_kind
from .registry import register_container as register_container
from .registry import registered as registered
from .registry import registry_snapshot as registry_snapshot
