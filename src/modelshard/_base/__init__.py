"""The base area's façade: the vocabulary every other area shares (errors, how things are
written for people, dtypes, canonical paths, meshes, folding numbered paths). It imports
nothing else from the package."""

from .dtypes import canonical_dtype as canonical_dtype
from .dtypes import dtype_name as dtype_name
from .errors import LIST_IN_FULL as LIST_IN_FULL
from .errors import AdapterError as AdapterError
from .errors import AssembleError as AssembleError
from .errors import CheckpointError as CheckpointError
from .errors import DistributedError as DistributedError
from .errors import MappingError as MappingError
from .errors import MeshError as MeshError
from .errors import ModelshardError as ModelshardError
from .errors import Problem as Problem
from .errors import ShardingMismatchError as ShardingMismatchError
from .errors import SpecError as SpecError
from .folding import fold as fold
from .mesh import current_mesh as current_mesh
from .mesh import is_abstract as is_abstract
from .mesh import make_mesh as make_mesh
from .mesh import mesh_sizes as mesh_sizes
from .paths import format_path as format_path
from .paths import join as join
from .paths import key_name as key_name
from .paths import split as split
from .progress import Progress as Progress
from .progress import reporter as reporter
from .text import SHOW_ALL as SHOW_ALL
from .text import TOML_NONE as TOML_NONE
from .text import close_match as close_match
from .text import escape_markup as escape_markup
from .text import format_bytes as format_bytes
from .text import format_mesh as format_mesh
from .text import format_spec as format_spec
from .text import literal as literal
from .text import quote_pattern as quote_pattern
from .text import speaking as speaking
from .text import spec_json as spec_json
from .text import toml_entry as toml_entry
from .text import toml_spec as toml_spec
from .text import vocabulary as vocabulary
from .toml import check_keys as check_keys
from .toml import flag as flag
from .toml import read_toml as read_toml
from .toml import tables as tables
from .toml import unknown_key as unknown_key
from .units import size_in_bytes as size_in_bytes
