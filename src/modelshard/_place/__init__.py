"""The placement area's façade: everything that puts arrays on a mesh by a plan."""

from .arguments import NOSPEC as NOSPEC
from .arguments import ArgumentLayout as ArgumentLayout
from .arguments import Slot as Slot
from .arguments import invalid as invalid
from .constraints import ActivationConstraint as ActivationConstraint
from .constraints import constrain as constrain
from .constraints import recording_constraints as recording_constraints
from .constraints import strict_constraints as strict_constraints
from .placement import assemble as assemble
from .placement import assemble_process_local as assemble_process_local
from .placement import global_shape as global_shape
from .placement import partitions as partitions
from .placement import place as place
from .placement import shard as shard
from .planning import Plan as Plan
from .planning import parse_bytes as parse_bytes
from .planning import plan as plan
from .shard_mapping import ShardMap as ShardMap
from .shard_mapping import shard_map as shard_map
