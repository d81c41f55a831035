"""modelshard: make JAX model state shardable as one value.

Adapters split any registered container into array leaves with canonical paths; one rule
engine expands a spec per argument onto every leaf and validates them all at once; every
entry point (``plan``, ``shard``, ...) consumes that pipeline.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from . import adapters as adapters
from . import cli as cli
from . import distributed as distributed
from ._base import AdapterError as AdapterError
from ._base import AssembleError as AssembleError
from ._base import CheckpointError as CheckpointError
from ._base import DistributedError as DistributedError
from ._base import FitError as FitError
from ._base import ForeignStepError as ForeignStepError
from ._base import ForeignStepsWarning as ForeignStepsWarning
from ._base import MappingError as MappingError
from ._base import MeshError as MeshError
from ._base import ModelshardError as ModelshardError
from ._base import PartialRestoreWarning as PartialRestoreWarning
from ._base import Problem as Problem
from ._base import ShardingMismatchError as ShardingMismatchError
from ._base import SpecError as SpecError
from ._base import make_mesh as make_mesh
from ._checkpoint import CheckpointManager as CheckpointManager
from ._checkpoint import read_items as read_items
from ._checkpoint import read_metadata as read_metadata
from ._checkpoint import reshard as reshard
from ._checkpoint import restore as restore
from ._checkpoint import save as save
from ._containers import register_container as register_container
from ._fit import FitAdvice as FitAdvice
from ._fit import StepMemory as StepMemory
from ._fit import Suggestion as Suggestion
from ._fit import fit_advice as fit_advice
from ._fit import step_memory as step_memory
from ._jit import ShardJit as ShardJit
from ._jit import shard_jit as shard_jit
from ._place import ActivationConstraint as ActivationConstraint
from ._place import Plan as Plan
from ._place import ShardMap as ShardMap
from ._place import assemble as assemble
from ._place import assemble_process_local as assemble_process_local
from ._place import constrain as constrain
from ._place import global_shape as global_shape
from ._place import partitions as partitions
from ._place import plan as plan
from ._place import shard as shard
from ._place import shard_map as shard_map
from ._place import strict_constraints as strict_constraints
from ._specs import FSDP as FSDP
from ._specs import ArgPlan as ArgPlan
from ._specs import LeafPlan as LeafPlan
from ._specs import LogicalAxes as LogicalAxes
from ._specs import Rules as Rules
from ._specs import fsdp as fsdp
from ._specs import load_rules as load_rules
from ._specs import logical_rules as logical_rules
from ._weights import Add as Add
from ._weights import Concat as Concat
from ._weights import MapRule as MapRule
from ._weights import Rearrange as Rearrange
from ._weights import Reshape as Reshape
from ._weights import Scale as Scale
from ._weights import ShippedMapping as ShippedMapping
from ._weights import Split as Split
from ._weights import Stack as Stack
from ._weights import Transpose as Transpose
from ._weights import Unstack as Unstack
from ._weights import WeightMap as WeightMap
from ._weights import load_safetensors as load_safetensors
from ._weights import load_weight_map as load_weight_map
from ._weights import save_peft_adapter as save_peft_adapter
from ._weights import save_safetensors as save_safetensors
from ._weights import shipped_mappings as shipped_mappings
from ._weights import unmap as unmap

try:
    __version__ = _version("modelshard")
except _PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"
