"""The packed-code Marlin kernel compiled for Hopper and run by Triton's interpreter on the CPU (where Triton is installed; CI has none and
skips): every fast format against the dense path, its weights bit for bit (one-hot input rows), a row's bits
independent of the other rows and of the passes a long call is cut into. It found a bug
the element-wise CPU checks could not (a strided table handed to the kernel as if contiguous)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.mark.slow  # about four minutes on two cores: `pytest -m slow tests/unit/reference/test_marlin_rows_interpreter.py`
def test_the_kernel_agrees_with_the_dense_path_in_the_interpreter() -> None:
    script = Path(__file__).with_name("marlin_rows_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[3])}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("written and notes the same: True") == 11, done.stdout
    assert done.stdout.count("epilogue's bit for bit: True") == 11, done.stdout
    assert done.stdout.count("dense decoder's weights bit for bit: True") == 11, done.stdout


COMPILE_CASES = [
    (four, scale_bytes, offset, block_m)
    for four in (True, False)
    for scale_bytes in (True, False)
    for offset in (True, False)
    for block_m in (4, 16)
    if not (scale_bytes and offset)  # byte scales (FP4/MX formats) never come with zero points
]


@pytest.mark.parametrize(("four_bit", "scale_bytes", "has_offset", "block_m"), COMPILE_CASES)
def test_the_kernel_compiles_for_hopper_without_spills_or_flushed_denormals(
    four_bit: bool, scale_bytes: bool, has_offset: bool, block_m: int
) -> None:
    """Triton compiles for sm_90 without a GPU: every launch variant builds a cubin, keeps its accumulators in
    registers (no local memory) and flushes no denormal (no ``.ftz``: the weights must be the dense decoder's)."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from moereplay.reference.marlin_rows import BLOCK_N, NUM_WARPS
    from moereplay.reference.marlin_rows_kernel import marlin_rows

    names = list(inspect.signature(marlin_rows.fn).parameters)
    pointers = {
        "staged_ptr": "*i64", "out_ptr": "*fp32", "w_ptr": "*i32" if four_bit else "*u8",
        "column_entries_ptr": "*i32", "row_entries_ptr": "*i32", "lut_ptr": "*fp32",
        "scale_ptr": "*u8" if scale_bytes else "*bf16",
        "columns_ptr": "*i64", "scale_lut_ptr": "*fp32", "multipliers_ptr": "*fp32", "offset_ptr": "*fp32",
        "tiles_ptr": "*i64",
    }  # fmt: skip
    constants = {
        "FOUR_BIT": four_bit,
        "SCALE_BYTES": scale_bytes,
        "HAS_OFFSET": has_offset,
        "TILE_BYTES": 512 if four_bit else 1024,
        "BLOCK_M": block_m,
        "BLOCK_N": BLOCK_N,
        "DECODE": 1 if four_bit else 0,  # 4-bit: FP4 E2M1 by integer operations
        "BIAS": 0,
        "ROW_STEP": 128,
        "ROW_HALF": 16,
    }
    assert set(pointers) <= set(names) and set(constants) <= set(names)
    floats = {"multiplier_factor": "fp32"}
    signature = {n: pointers.get(n, floats.get(n, "constexpr" if n in constants else "i32")) for n in names}
    source = ASTSource(
        marlin_rows, signature, constexprs={(names.index(n),): v for n, v in constants.items()}
    )
    built = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
    ptx = built.asm["ptx"]
    assert built.asm["cubin"]
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ".ftz" not in ptx
    columns_a_thread = BLOCK_N // (32 * NUM_WARPS)
    # every tile row's multiply-add is a fused one
    assert ptx.count("fma.rn.f32") >= block_m * 16 * columns_a_thread
    # the staged activations come two rows to an 8-byte load (and 4-bit codes' value pairs the same way)
    assert ptx.count("ld.global.b64") >= 16 * block_m // 2
    if four_bit:  # codes come as 32-bit words, never byte by byte (byte-wide loads are the scales' only), and
        # are decoded without a table: the 32-bit loads are the words, the scales and the tile fields
        assert ptx.count("ld.global.b32") <= 4 * columns_a_thread + 16 + 8, ptx.count("ld.global.b32")
        byte_loads = ptx.count("ld.global.u8") + ptx.count("ld.global.b8")
        assert byte_loads <= (2 if scale_bytes else 0) * columns_a_thread


def test_the_staging_kernel_compiles_for_hopper() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from moereplay.reference.marlin_rows import STAGE_BLOCK_K
    from moereplay.reference.marlin_rows_kernel import stage_rows

    signature = {
        "x_ptr": "*bf16", "stride_xm": "i32", "stride_xk": "i32", "src_ptr": "*i64", "tiles_ptr": "*i64",
        "staged_ptr": "*fp32", "K": "i32", "BLOCK_K": "constexpr",
    }  # fmt: skip
    built = compile(
        ASTSource(stage_rows, signature, constexprs={(7,): STAGE_BLOCK_K}), target=GPUTarget("cuda", 90, 32)
    )
    assert built.asm["cubin"] and "ld.local" not in built.asm["ptx"]


COUNT_SCRIPT = """
import torch
from moereplay.reference.marlin_rows_kernel import count_scale_bytes
scales = torch.randint(0, 256, (5, 3, 700), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
scales[1, 0, :40] = 0xFF
experts = torch.tensor([4, 1, 1, 0, -1, -1])  # a device-routed list: -1 after the used experts
for nan in (True, False):
    total = torch.zeros((), dtype=torch.int64)
    count_scale_bytes[(6, 3)](scales.view(5, -1), experts, 2100, total, E8M0_NAN=nan, BLOCK=1024)
    raw = scales[experts[experts >= 0]]
    expected = (raw == 0xFF) if nan else (((raw & 0x80) == 0) & (raw != 0))
    print(int(total), int(expected.sum()))
"""


def test_the_scale_byte_count_kernel_counts_what_torch_counts() -> None:
    """The weight notes' one-pass count (GPU path of ``_count_scale_bytes``), run by Triton's interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[3])}
    done = subprocess.run(
        [sys.executable, "-c", COUNT_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 2 and all(got == want for got, want in lines), done.stdout
    assert int(lines[0][0]) >= 2 * 40  # expert 1 twice: its 40 NaN bytes counted each time


def test_the_device_routing_is_the_host_routing_in_the_interpreter() -> None:
    """``route_rows`` (the Marlin reference's routing on the GPU, one program) run by Triton's interpreter: the same
    row tables, grouped order, used experts and row blocks as the host's numpy routing, and a summary that asks
    for exactly the host's notes — aligned routings (int32 and int64, the total as a tensor or an int, gemm2's top-k
    of 1, strided views, 1 to 1,000 experts, experts with several 16-row blocks) and every anomaly, alone and mixed at random."""
    script = Path(__file__).with_name("route_rows_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[3])}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 73 and all(": same (" in line for line in lines), done.stdout
    for code in ("negative_sorted_id", "padding_inside_block", "invalid_block_expert", "duplicate_slot",
                 "padded_total_exceeds_buffers", "padded_total_not_multiple"):  # fmt: skip
        assert any(f"notes ['{code}']" in line for line in lines), code  # each anomaly alone at least once


def test_the_routing_kernel_compiles_for_hopper() -> None:
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from moereplay.reference.marlin_rows import ROUTE_BLOCK, ROUTE_CELLS
    from moereplay.reference.marlin_rows_kernel import route_rows

    names = list(inspect.signature(route_rows.fn).parameters)
    pointers = {
        "ids_ptr": "*i32", "experts_ptr": "*i32", "total_ptr": "*i32", "last_ptr": "*i32", "rank_ptr": "*i32",
        "start_ptr": "*i32", "tables_ptr": "*i64", "source_ptr": "*i64", "destination_ptr": "*i64",
        "fields_ptr": "*i64", "used_ptr": "*i64", "summary_ptr": "*i64",
    }  # fmt: skip
    for experts in (32, 1024):
        constants = {
            "TOTAL_IN_MEMORY": True,
            "BLOCK": ROUTE_BLOCK,
            "ROWS": ROUTE_CELLS // experts,
            "EXPERTS": experts,
        }
        signature = {n: pointers.get(n, "constexpr" if n in constants else "i32") for n in names}
        source = ASTSource(
            route_rows, signature, constexprs={(names.index(n),): v for n, v in constants.items()}
        )
        built = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert built.asm["cubin"]
