"""The weights area's façade: pretrained weights in and out through one mapping language
(README.md beside this module gives the design)."""

from __future__ import annotations

from .export import check_destination as check_destination
from .export import save_safetensors as save_safetensors
from .export import write_export as write_export
from .export import write_safetensors as write_safetensors
from .inverse import Exporter as Exporter
from .inverse import reference_table as reference_table
from .inverse import unmap as unmap
from .load import as_mapping as as_mapping
from .load import keep_value as keep_value
from .load import leaf_shardings as leaf_shardings
from .load import load_safetensors as load_safetensors
from .load import mapped_leaves as mapped_leaves
from .load import resolve_target as resolve_target
from .mapfile import load_weight_map as load_weight_map
from .mapfile import parse_weight_map as parse_weight_map
from .model_dir import finish_model_directory as finish_model_directory
from .model_dir import is_model_directory as is_model_directory
from .model_dir import shard_size_for as shard_size_for
from .ops import Add as Add
from .ops import Rearrange as Rearrange
from .ops import Reshape as Reshape
from .ops import Scale as Scale
from .ops import Transpose as Transpose
from .peft_adapter import save_peft_adapter as save_peft_adapter
from .recipe import Cast as Cast
from .recipe import Node as Node
from .recipe import Read as Read
from .recipe import Spec as Spec
from .recipe import carried_spec as carried_spec
from .recipe import needed_specs as needed_specs
from .recipe import norm_index as norm_index
from .recipe import on_key_data as on_key_data
from .recipe import unaliased as unaliased
from .resolver import resolve as resolve
from .rules import Concat as Concat
from .rules import MapRule as MapRule
from .rules import Split as Split
from .rules import Stack as Stack
from .rules import Unstack as Unstack
from .rules import WeightMap as WeightMap
from .safetensors import is_safetensors as is_safetensors
from .safetensors import open_safetensors as open_safetensors
from .shipped import ShippedMapping as ShippedMapping
from .shipped import shipped_mappings as shipped_mappings
from .writing import parse_size as parse_size
