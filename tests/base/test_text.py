"""The spec JSON codec: one spelling for plans, errors and checkpoint records."""

from __future__ import annotations

import json

import pytest
from jax.sharding import PartitionSpec as P

from modelshard._base import spec_from_json, spec_json


@pytest.mark.parametrize("spec", [P(), P(None), P("data", None), P(("data", "fsdp"), "model")])
def test_spec_json_round_trips_through_json_text(spec: P) -> None:
    text = json.dumps(spec_json(spec))
    assert spec_from_json(json.loads(text)) == spec


def test_spec_json_spells_tuples_as_lists_and_none_as_null() -> None:
    assert json.dumps(spec_json(P("data", None, ("a", "b")))) == '["data", null, ["a", "b"]]'
    assert spec_json(None) is None and spec_from_json(None) is None


def test_one_spec_codec_in_the_package() -> None:
    from modelshard._checkpoint import record

    assert record.spec_json is spec_json and record.spec_from_json is spec_from_json
