"""The weights area's façade: pretrained weights in and out through one mapping language.

[`WeightMap`][modelshard.WeightMap] (rules from stored tensor names to canonical target paths, with
transforms), its TOML form, ``load_safetensors`` / ``save_safetensors``, and what
``restore(mapping=...)`` and the CLI's ``convert`` need. README.md beside this module gives
the design.
"""

from __future__ import annotations

from .load import Exporter as Exporter
from .load import MappedLeaf as MappedLeaf
from .load import as_mapping as as_mapping
from .load import invert_resolution as invert_resolution
from .load import keep_value as keep_value
from .load import leaf_shardings as leaf_shardings
from .load import load_safetensors as load_safetensors
from .load import mapped_leaves as mapped_leaves
from .load import nest_paths as nest_paths
from .load import place_mapped as place_mapped
from .load import reference_table as reference_table
from .load import resolve_target as resolve_target
from .load import save_safetensors as save_safetensors
from .load import target_table as target_table
from .load import unmap as unmap
from .load import write_export as write_export
from .mapfile import load_weight_map as load_weight_map
from .mapfile import parse_weight_map as parse_weight_map
from .mapping import Add as Add
from .mapping import Concat as Concat
from .mapping import MapRule as MapRule
from .mapping import Rearrange as Rearrange
from .mapping import Reshape as Reshape
from .mapping import Resolution as Resolution
from .mapping import Scale as Scale
from .mapping import Split as Split
from .mapping import Stack as Stack
from .mapping import Transpose as Transpose
from .mapping import Unstack as Unstack
from .mapping import WeightMap as WeightMap
from .mapping import resolve as resolve
from .safetensors import is_safetensors as is_safetensors
from .safetensors import open_safetensors as open_safetensors
from .safetensors import parse_size as parse_size
from .safetensors import sharded_layout as sharded_layout
from .safetensors import sharded_names as sharded_names
from .safetensors import write_safetensors as write_safetensors
from .transforms import Cast as Cast
from .transforms import Node as Node
from .transforms import Read as Read
from .transforms import Spec as Spec
from .transforms import carried_spec as carried_spec
from .transforms import needed_specs as needed_specs
from .transforms import norm_index as norm_index
from .transforms import on_key_data as on_key_data
from .transforms import unaliased as unaliased
