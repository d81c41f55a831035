"""The specs area's façade: the spec language and ``expand_args``, the one pipeline."""

from .expand import ArgPlan as ArgPlan
from .expand import LeafPlan as LeafPlan
from .expand import expand_args as expand_args
from .language import FSDP as FSDP
from .language import Rules as Rules
from .language import SpecLike as SpecLike
from .language import entry_axes as entry_axes
from .language import fsdp as fsdp
from .language import is_axes_entry as is_axes_entry
from .language import is_entry as is_entry
from .language import is_leaf_spec as is_leaf_spec
from .logical import LogicalAxes as LogicalAxes
from .logical import active_logical as active_logical
from .logical import check_mesh_axes as check_mesh_axes
from .logical import logical_rules as logical_rules
from .resolution import Via as Via
from .rulesfile import load_rules as load_rules
