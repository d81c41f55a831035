"""``MODELSHARD_BARRIER_TIMEOUT`` and ``MODELSHARD_HEARTBEAT_TIMEOUT`` take the same forms
(one parser): whole or fractional seconds; the same values are refused, with one message."""

from __future__ import annotations

import pytest

import modelshard as ms
from modelshard._runtime import distributed
from modelshard._runtime import processes as _launch

NAMES = ["MODELSHARD_BARRIER_TIMEOUT", "MODELSHARD_HEARTBEAT_TIMEOUT"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("raw", "seconds"), [("5", 5.0), ("5.0", 5.0), ("2.5", 2.5), ("", None)])
def test_both_timeouts_read_seconds_alike(name, raw, seconds):
    assert distributed.env_seconds(name, {name: raw}) == seconds


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("raw", ["0", "-3", "soon", "inf", "nan", "5s"])
def test_both_timeouts_refuse_the_same_values(name, raw):
    with pytest.raises(ms.DistributedError) as e:
        distributed.env_seconds(name, {name: raw})
    assert str(e.value) == (
        f"environment variable {name}={raw!r} must be a positive number of seconds."
    )


def test_a_fractional_heartbeat_timeout_reaches_jax_rounded_up(monkeypatch):
    started = []
    monkeypatch.setattr(distributed, "_start", lambda **kw: started.append(kw))
    for name, value in {
        "MODELSHARD_COORDINATOR": "127.0.0.1:1",
        "MODELSHARD_NUM_PROCESSES": "2",
        "MODELSHARD_PROCESS_ID": "1",
    }.items():
        monkeypatch.setenv(name, value)
    for raw in ("5.0", "5.5"):
        monkeypatch.setenv("MODELSHARD_HEARTBEAT_TIMEOUT", raw)
        assert distributed.initialize() is True
    assert [kw["heartbeat_timeout_seconds"] for kw in started] == [5, 6]


def test_launch_passes_a_fractional_heartbeat_timeout_on():
    args = _launch._parser().parse_args(["-n", "2", "--heartbeat-timeout", "2.5", "--", "x"])
    env = _launch.child_env({}, "127.0.0.1:1", 2, 0, 1, args.heartbeat_timeout)
    assert env["MODELSHARD_HEARTBEAT_TIMEOUT"] == "2.5"
    assert distributed.env_seconds("MODELSHARD_HEARTBEAT_TIMEOUT", env) == 2.5
