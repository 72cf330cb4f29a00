from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from moereplay.capture.settings import (
    LayerSelection,
    StepRange,
    Trigger,
    settings_from_environ,
    unknown_variables,
)
from moereplay.errors import SettingsError


def parse(**values: str):
    env = {"MOEREPLAY_CAPTURE": "1"}
    env.update({f"MOEREPLAY_{key.upper()}": value for key, value in values.items()})
    return settings_from_environ(env, now=datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc))


def test_off_by_default_and_other_variables_are_not_parsed() -> None:
    assert not settings_from_environ({}).enabled
    assert not settings_from_environ({"MOEREPLAY_CAPTURE": "0", "MOEREPLAY_MAX_BYTES": "garbage"}).enabled
    assert not settings_from_environ({"MOEREPLAY_CAPTURE": " off "}).enabled


def test_defaults() -> None:
    settings = parse()
    assert settings.enabled
    # not ./captures/: that is where moereplay's own checkout (and many projects) keep example files
    assert settings.directory == Path("moereplay-captures/run-20250102-030405")
    assert settings.directory_was_default
    assert settings.trigger is Trigger.ALWAYS
    assert settings.op_selected("moe_wna16_marlin_gemm")
    assert (settings.max_calls, settings.max_bytes, settings.per_shape, settings.sample) == (0, 0, 0, 1.0)
    assert not settings.flight_stream_stores
    assert not settings.flight_beside_driver and "flight_beside_driver" not in settings.describe()
    assert settings.flight_inline_checks


def test_every_variable() -> None:
    settings = parse(
        dir="/tmp/x",
        ops="moe_*,matmul*",
        ops_exclude="matmul",
        layers="0-2,7,*.layers.1?.*",
        steps="10-20",
        max_calls="100",
        max_bytes="1.5G",
        per_shape="3",
        sample="1/4",
        trigger="flight",
        flight_calls="8",
        flight_bytes="64M",
        absmax="1e4",
        queue_calls="16",
        queue_bytes="512MiB",
        compression_level="3",
        compression_threads="-1",
        flight_stream_stores="on",
        flight_beside_driver="1",
        flight_inline_checks="0",
        flight_output_bytes="8M",
        flight_lean_bytes="16M",
    )
    assert settings.directory == Path("/tmp/x") and not settings.directory_was_default
    assert settings.op_selected("moe_wna16_marlin_gemm") and settings.op_selected("matmul_ogs")
    assert not settings.op_selected("matmul") and not settings.op_selected("fused_marlin_moe")
    assert settings.layers == LayerSelection(frozenset({0, 1, 2, 7}), ("*.layers.1?.*",))
    assert settings.layers.contains(None, "model.layers.12.mlp.experts")
    assert not settings.layers.contains(3, "model.layers.3.mlp.experts")
    assert settings.steps == StepRange(10, 20)
    assert settings.max_calls == 100 and settings.max_bytes == int(1.5 * 2**30) and settings.per_shape == 3
    assert settings.sample == 0.25 and settings.trigger is Trigger.FLIGHT
    assert (settings.flight_calls, settings.flight_bytes, settings.absmax) == (8, 64 << 20, 1e4)
    assert (settings.queue_calls, settings.queue_bytes) == (16, 512 << 20)
    assert (settings.compression_level, settings.compression_threads) == (3, -1)
    assert "trigger=flight" in settings.describe() and "zstd=3 zstd_threads=-1" in settings.describe()
    assert settings.flight_stream_stores and "flight_stream_stores=on" in settings.describe()
    assert settings.flight_beside_driver and "flight_beside_driver=on" in settings.describe()
    assert not settings.flight_inline_checks and "flight_inline_checks=off" in settings.describe()
    assert settings.flight_output_bytes == 8 << 20 and "flight_output_bytes=8388608" in settings.describe()
    assert settings.flight_lean_bytes == 16 << 20 and "flight_lean_bytes=16777216" in settings.describe()


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ("5", StepRange(5, 5)),
        ("3-", StepRange(3, None)),
        ("-9", StepRange(None, 9)),
        (" 1 - 2 ", StepRange(1, 2)),
    ],
)
def test_step_ranges(steps: str, expected: StepRange) -> None:
    assert parse(steps=steps).steps == expected


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("capture", "maybe", "MOEREPLAY_CAPTURE='maybe': not a boolean"),
        ("max_bytes", "12X", "MOEREPLAY_MAX_BYTES='12X': not a size"),
        ("max_calls", "-1", "MOEREPLAY_MAX_CALLS='-1': must be >= 0"),
        ("max_calls", "ten", "MOEREPLAY_MAX_CALLS='ten': not an integer"),
        ("sample", "0", "MOEREPLAY_SAMPLE='0': must be in (0, 1]"),
        ("sample", "1/0", "not a fraction"),
        ("steps", "9-3", "ends before it starts"),
        ("steps", "-", "not a step range"),
        ("layers", "5-2", "ends before it starts"),
        ("layers", "1-2-3", "neither an index"),
        ("trigger", "sometimes", "unknown trigger"),
        ("flight_calls", "0", "must be >= 1"),
        ("absmax", "nan", "finite number > 0"),
        ("absmax", "-3", "finite number > 0"),
        ("ops", " , ", "no pattern given"),
        ("compression_level", "23", "must be in [-5, 22]"),
        ("compression_threads", "-2", "must be in [-1, 256]"),
        ("compression_threads", "x", "not an integer"),
        ("timers", "sometimes", "MOEREPLAY_TIMERS='sometimes': not a boolean"),
        ("flight_stream_stores", "2", "MOEREPLAY_FLIGHT_STREAM_STORES='2': not a boolean"),
        ("flight_beside_driver", "driver", "MOEREPLAY_FLIGHT_BESIDE_DRIVER='driver': not a boolean"),
        ("flight_inline_checks", "some", "MOEREPLAY_FLIGHT_INLINE_CHECKS='some': not a boolean"),
        ("flight_graph_poll_ms", "4", "MOEREPLAY_FLIGHT_GRAPH_POLL_MS='4': must be in [5, 500]"),
        ("flight_graph_poll_ms", "fast", "not an integer"),
        ("flight_graph_batch", "2", "MOEREPLAY_FLIGHT_GRAPH_BATCH='2': not a boolean"),
        ("flight_graph_compact", "yes please", "MOEREPLAY_FLIGHT_GRAPH_COMPACT='yes please': not a boolean"),
        ("flight_output_bytes", "big", "MOEREPLAY_FLIGHT_OUTPUT_BYTES='big': not a size"),
        ("flight_lean_bytes", "-1", "MOEREPLAY_FLIGHT_LEAN_BYTES='-1'"),
    ],
)
def test_malformed_values_raise_one_line(variable: str, value: str, fragment: str) -> None:
    env = {"MOEREPLAY_CAPTURE": "1", f"MOEREPLAY_{variable.upper()}": value}
    with pytest.raises(SettingsError) as caught:
        settings_from_environ(env)
    message = str(caught.value)
    assert fragment in message
    assert "\n" not in message


def test_empty_values_mean_default() -> None:
    assert parse(max_calls="", trigger=" ").max_calls == 0


def test_unknown_capture_like_variables_are_reported_not_fatal() -> None:
    env = {
        "MOEREPLAY_CAPTURE": "1",
        "MOEREPLAY_MAXCALLS": "3",
        "MOEREPLAY_CAPTURE_DIR": "/x",
        "MOEREPLAY_PACK": "p",
    }
    assert unknown_variables(env) == ("MOEREPLAY_CAPTURE_DIR", "MOEREPLAY_MAXCALLS")
    assert settings_from_environ(env).enabled
