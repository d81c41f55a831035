"""A URL is never made a ``pathlib.Path`` on its way into a message: ``Path("s3://b/run")``
is ``s3:/b/run``, which names another place (a local folder) in the fix a user copies."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms


def test_the_reshard_refusal_of_a_manager_step_on_s3_names_its_url(s3_root, tmp_path):
    with ms.CheckpointManager(s3_root, async_save=False, handle_signals=False) as mngr:
        mngr.save(4, {"w": jnp.ones((8, 2))}, items={"config": {"lr": 0.1}})
    with pytest.raises(ms.CheckpointError) as e:
        ms.reshard(
            f"{s3_root}/4", tmp_path / "out", specs=P("data"), mesh=ms.make_mesh({"data": 8})
        )
    assert str(e.value) == (
        f"{s3_root}/4 is step 4 of a CheckpointManager and holds items (config) beside its "
        "arrays; a resharded checkpoint holds arrays only, so they would be lost. Keep them: "
        f"read CheckpointManager({s3_root!r}).items(4) and .metrics(4) and save them with the "
        "resharded state; or pass drop_items=True to reshard the arrays without them."
    )
    assert not (tmp_path / "out").exists()
