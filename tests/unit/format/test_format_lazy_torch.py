"""Reading a capture's index and call records — ``moereplay ls``/``info``, the TUI's rows — does not import torch
(about 200 MB resident and a second of start-up); loading tensors does.

Each check runs in a fresh interpreter, so that what this test process (or another test) imported cannot hide an
import; the child prints one JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from moereplay.format import CaptureReader, CaptureWriter
from moereplay.format.dtypes import ITEMSIZES
from moereplay.format.tensors import DTYPES

CAPTURES = Path(__file__).resolve().parents[3] / "captures"
CHECKED_IN = sorted(CAPTURES.glob("*.moe.zst"))


def _run(script: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tensors of several dtypes (a static weight, an in-place output), scalars, a context, an unfinished call."""
    path = tmp_path_factory.mktemp("lazy") / "calls.moe.zst"
    weight = torch.arange(64, dtype=torch.int32).reshape(4, 16)
    with CaptureWriter(path, header={"rank": 0}) as writer:
        for number in range(5):
            out = torch.zeros(4, 8, dtype=torch.bfloat16)
            index = writer.begin_call(
                "moe_wna16_marlin_gemm",
                {
                    "input": torch.full((4, 16), float(number), dtype=torch.float16),
                    "b_qweight": weight,
                    "scales": torch.ones(2, dtype=torch.float8_e4m3fn),
                    "out": out,
                    "top_k": 2,
                    "mul_topk_weights": number % 2 == 0,
                    "sizes": (4, 16),
                },
                site=f"test:{number}",
                context={"layer": number % 3, "step": number},
                static={"b_qweight"},
            )
            if number < 4:
                writer.complete_call(index, {"out": out.add_(1)})
    return path


def test_static_item_sizes_match_this_torch() -> None:
    """The torch-free table names every dtype this torch has, with torch's item size."""
    every = {
        str(value).removeprefix("torch."): value
        for value in (getattr(torch, name, None) for name in dir(torch))
        if isinstance(value, torch.dtype)
    }
    assert {name: dtype.itemsize for name, dtype in every.items()} == {
        name: ITEMSIZES[name] for name in every if name in ITEMSIZES
    }
    assert set(every) <= set(ITEMSIZES), (
        f"add to moereplay.format.dtypes: {sorted(set(every) - set(ITEMSIZES))}"
    )
    assert set(DTYPES) == set(every)


@pytest.mark.parametrize("path", CHECKED_IN, ids=lambda path: path.name)
def test_listing_checked_in_captures_imports_no_torch(path: Path) -> None:
    script = (
        "import json, sys\n"
        "from moereplay.format import CaptureReader\n"
        "from moereplay.format.summary import capture_info, list_calls\n"
        f"path = {str(path)!r}\n"
        "with CaptureReader(path) as reader:\n"
        "    records = list(reader.calls())\n"
        "    shapes = [meta.describe() for record in records for meta in record.arg_tensors.values()]\n"
        "info = capture_info(path).to_json()\n"
        "_, rows = list_calls(path)\n"
        "texts = [row.key_tensors() for row in rows] + [json.dumps(row.to_json()) for row in rows]\n"
        "print(json.dumps({'calls': len(records), 'shapes': len(shapes), 'rows': len(rows),"
        " 'torch': 'torch' in sys.modules}))\n"
    )
    found = _run(script)
    assert found["calls"] == found["rows"] > 0
    assert found["shapes"] > 0
    assert found["torch"] is False


def test_listing_then_loading(capture: Path) -> None:
    """Listing leaves torch alone; the first tensor load imports it and returns the recorded values."""
    script = (
        "import json, sys\n"
        "from moereplay.format import CaptureReader\n"
        f"with CaptureReader({str(capture)!r}) as reader:\n"
        "    records = list(reader.calls())\n"
        "    stats = reader.stats()\n"
        "    listed = 'torch' in sys.modules\n"
        "    args = reader.load_args(1)\n"
        "    outputs = reader.load_outputs(1)\n"
        "print(json.dumps({'listed_torch': listed, 'loaded_torch': 'torch' in sys.modules,"
        " 'statuses': [record.status for record in records], 'layers': [record.layer for record in records],"
        " 'input': args['input'].float().sum().item(), 'scales': str(args['scales'].dtype),"
        " 'out': outputs['out'].float().sum().item(), 'sizes': list(args['sizes']), 'calls': stats.calls}))\n"
    )
    found = _run(script)
    assert found["listed_torch"] is False
    assert found["loaded_torch"] is True
    assert found["statuses"] == ["completed"] * 4 + ["inputs_saved"]
    assert found["layers"] == [0, 1, 2, 0, 1]
    assert found["input"] == 64.0
    assert found["scales"] == "torch.float8_e4m3fn"
    assert found["out"] == 32.0
    assert found["sizes"] == [4, 16]


def test_record_with_a_dtype_value_imports_torch_to_decode_it(tmp_path: Path) -> None:
    """A dtype in a call record is decoded to the real ``torch.dtype`` (torch is imported then, not before)."""
    path = tmp_path / "dtype.moe.zst"
    with CaptureWriter(path) as writer:
        writer.begin_call(
            "op", {"dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2])}
        )
    script = (
        "import json, sys\n"
        "from moereplay.format import CaptureReader\n"
        f"reader = CaptureReader({str(path)!r})\n"
        "opened = 'torch' in sys.modules\n"
        "record = reader.call(0)\n"
        "import torch\n"
        "print(json.dumps({'opened_torch': opened, 'dtype': record.args['dtype'] is torch.bfloat16,"
        " 'device': record.args['device'] == torch.device('cpu'), 'size': type(record.args['size']) is torch.Size}))\n"
    )
    assert _run(script) == {"opened_torch": False, "dtype": True, "device": True, "size": True}


@pytest.mark.parametrize("command", ["ls", "info", "ls --json", "info --json"])
def test_inspect_commands_import_no_torch(capture: Path, command: str) -> None:
    script = (
        "import json, sys\n"
        "from moereplay.cli import main\n"
        "code = 0\n"
        "try:\n"
        f"    main({command.split()!r} + [{str(capture)!r}])\n"
        "except SystemExit as exit:\n"
        "    code = exit.code or 0\n"
        "print()\n"
        "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    *printed, last = result.stdout.strip().splitlines()
    assert json.loads(last) == {"code": 0, "torch": False}
    assert "moe_wna16_marlin_gemm" in "\n".join(printed) or command.startswith("info")


def test_reader_still_hands_out_torch_values_in_process(capture: Path) -> None:
    """In a process that has torch, loading works as before: views, dtypes and aliasing."""
    with CaptureReader(capture) as reader:
        args = reader.load_args(0)
        outputs = reader.load_outputs(0)
        record = reader.call(0)
    assert args["b_qweight"].dtype is torch.int32
    assert torch.equal(args["b_qweight"], torch.arange(64, dtype=torch.int32).reshape(4, 16))
    assert args["sizes"] == (4, 16) and type(args["sizes"]) is tuple
    assert torch.equal(outputs["out"], torch.ones(4, 8, dtype=torch.bfloat16))
    assert record.aliases()
