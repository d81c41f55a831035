"""How one process's failure becomes the error every process raises (``shared_error``)."""

from __future__ import annotations

import modelshard as ms
from modelshard._runtime import outcome, shared_error
from modelshard._runtime.failures import is_shared


def test_nothing_failed_nothing_is_raised():
    assert shared_error(None, [None, None], "writing x") is None


def test_every_process_failed_each_raises_its_own():
    own = OSError(28, "No space left on device")
    assert shared_error(own, [outcome(own), outcome(OSError("other"))], "writing x") is own


def test_one_process_failed_every_process_raises_one_error_naming_it():
    own = OSError(28, "No space left on device")
    for mine in (own, None):
        error = shared_error(mine, [None, outcome(own)], "writing x")
        assert isinstance(error, ms.CheckpointError) and is_shared(error)
        assert str(error) == (
            "writing x failed on process 1: OSError: [Errno 28] No space left on device"
        )
        assert error.__cause__ is mine


def test_our_own_error_keeps_its_class_and_message_on_every_process():
    refused = ms.CheckpointError("/out already exists; pass overwrite=True to replace it")
    for mine in (refused, None):
        error = shared_error(mine, [outcome(refused), None], "creating /out")
        assert type(error) is ms.CheckpointError and str(error) == str(refused)
    lost = ms.DistributedError("process 1 did not reach the barrier")
    error = shared_error(None, [None, outcome(lost)], "writing x")
    assert type(error) is ms.DistributedError and str(error) == str(lost)
