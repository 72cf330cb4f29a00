"""The graph ring's Triton kernel where Triton is installed (``.ci/run`` installs Triton 3.8.0 for these; without
Triton they skip): run by Triton's interpreter on host memory through :meth:`GraphRing.capture`'s real arguments,
and compiled for Hopper without a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def interpreted(script: str) -> subprocess.CompletedProcess[str]:
    """A script beside this file run with ``TRITON_INTERPRET=1`` (must exit 0): its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[3])}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_graph_record_keeps_every_span_the_magnitude_and_the_token_count_in_the_interpreter() -> None:
    done = interpreted("graph_ring_interpreted.py")
    assert done.stdout.count("entries right: True") == 23, done.stdout
    assert (
        "tokens 1, 18 spans: 1 nodes (0 staging), 1 programs" in done.stdout
    )  # gpt-oss decode: one node, alone
    assert "tokens 8, 18 spans: 1 nodes (0 staging), 3 programs" in done.stdout  # the handshake
    assert "tokens 1, 26 spans: 2 nodes (0 staging), 1 programs" in done.stdout
    assert "tokens 1, 18 spans: 2 nodes (1 staging), 1 programs" in done.stdout  # staged: copy, then record
    assert "tokens 1, 26 spans: 3 nodes (2 staging), 1 programs" in done.stdout
    # a padded batch: the replay's token count in the metadata row, the padding rows' NaN left out of the check
    assert "tokens 8, 6 real, 18 spans: 1 nodes (0 staging), 3 programs" in done.stdout
    assert "tokens 2, 1 real, 18 spans: 2 nodes (1 staging), 1 programs" in done.stdout
    assert "tokens 8, 5 real, 26 spans: 2 nodes (0 staging), 3 programs" in done.stdout
    # larger than lone, staged: the copy, then a record node of three programs on the side stream
    assert "tokens 8, 6 real, 18 spans: 2 nodes (1 staging), 3 programs" in done.stdout
    # MOEREPLAY_FLIGHT_GRAPH_BATCH: a copy on the path per layer call, one node at the graph's end records them
    assert (
        "batch: 3 layers of 4 tokens: 3 staging nodes, 1 batch node(s), 0 record nodes, wrapped True"
        in done.stdout
    )
    assert (
        "batch: 5 layers of 4 tokens, 3 real: 5 staging nodes, 3 batch node(s), 0 record nodes" in done.stdout
    )
    assert "batch: 2 layers of 1 tokens: 2 staging nodes, 1 batch node(s), 0 record nodes" in done.stdout
    assert "batch: 4 layers of 4 tokens: 4 staging nodes, 2 batch node(s), 0 record nodes" in done.stdout
    # MOEREPLAY_FLIGHT_GRAPH_COMPACT: the batch node's one-loop kernel, the same cases, and a full batch of 24
    # entries (every lane) whose later entries start past the ring's end (the copy's split)
    assert done.stdout.count("(compact)") == 7, done.stdout
    assert (
        "batch: 5 layers of 4 tokens, 3 real (compact): 5 staging nodes, 3 batch node(s), 0 record nodes"
        in done.stdout
    )
    assert (
        "batch: 24 layers of 1 tokens (compact): 24 staging nodes, 1 batch node(s), 0 record nodes, wrapped True"
        in done.stdout
    )


def _hopper(kernel: Any, ints: list[str], constants: dict[str, int], tmp_path: Path) -> Any:
    """``kernel`` (``ints`` int64 arguments, then ``constants``) compiled for sm_90 without a GPU; asserts a cubin,
    no local memory, and — where Triton ships ptxas — no spills. Returns the compiled kernel."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    names = list(inspect.signature(kernel.fn).parameters)
    assert names == [*ints, *constants]
    signature = {name: "constexpr" if name in constants else "i64" for name in names}
    built = compile(
        ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constants.items()}),
        target=GPUTarget("cuda", 90, 32),
    )
    ptx = built.asm["ptx"]
    assert built.asm["cubin"]
    assert "ld.local" not in ptx and "st.local" not in ptx
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if ptxas.exists():  # e.g. the fold's first step held in registers across the copies must not spill
        source = tmp_path / "kernel.ptx"
        source.write_text(ptx)
        report = subprocess.run(
            [str(ptxas), "-arch=sm_90a", "-v", str(source), "-o", str(tmp_path / "kernel.cubin")],
            capture_output=True, text=True, timeout=120, check=True,
        ).stderr  # fmt: skip
        assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    return built


def test_an_output_checked_only_gets_the_fused_launchs_word_and_no_ring_byte_in_the_interpreter() -> None:
    """MOEREPLAY_FLIGHT_OUTPUT_BYTES: ``ring_copy`` with no span and the output checked where it is (mode 2) finishes
    the same word as the recorder's usual launch that copies the output and reduces its words (mode 3), publishes it
    to the host word, resets its counter, writes no ring byte, and its magnitude is what ``expand`` compares."""
    done = interpreted("ring_copy_interpreted.py")
    lines = done.stdout.splitlines()
    assert len(lines) == 15, done.stdout  # three dtypes, five values each
    for line in lines:
        assert "False" not in line and "counter 0," in line, line
        # mode 4: the same word, and the fingerprint byte_fingerprint recomputes (expand's bit-exact proof)
        assert "fingerprinted: word as fused True, counter 0, cell reset True" in line, line
        assert "halves tagged True, fingerprint right True" in line, line
        # mode 5 (record_lean's copy): the span copied exactly for NaN and Inf, the word published unchanged
        assert "right True, word kept True, published True, counter 0" in line, line
    assert "bfloat16 nan:" in done.stdout and "ok nan magnitude right: True" in done.stdout


@pytest.mark.parametrize("code", [1, 2, 3])
def test_the_fingerprinting_check_compiles_for_hopper_without_spills(tmp_path: Path, code: int) -> None:
    """sm_90 without a GPU: the ring kernel's mode 4 (the checked output's words read where they are for its check
    and fingerprint, no span of its own copied) is a cubin with no local memory or spills, reads the output in
    8-byte words, and adds each program's part of the fingerprint by one 64-bit atomic."""
    from moereplay.capture.ring_kernel import _INTS, BLOCK, ring_copy

    constants = {"ALIGNED": 1, "CODE": code, "MODE": 4, "BLOCK": BLOCK, "STREAM": 0}
    ptx = _hopper(ring_copy, _INTS, constants, tmp_path).asm["ptx"]
    assert "ld.global.b64" in ptx, ptx[:2000]
    # each program's part added, and the last one's read and reset of the cell
    assert "atom.global.gpu.relaxed.add.u64" in ptx and "atom.global.gpu.relaxed.exch.b64" in ptx


def test_the_copy_if_over_launch_compiles_for_hopper_without_spills(tmp_path: Path) -> None:
    """sm_90 without a GPU: mode 5 (``record_lean``'s copy, made only if the finished word's check is over the
    limit) is a cubin with no local memory or spills; it reads the word, compares its low 32 bits (not the
    generation above them) with the limit, and folds nothing into the word (no ``atomic_max``)."""
    from moereplay.capture.ring_kernel import _INTS, BLOCK, ring_copy

    constants = {"ALIGNED": 1, "CODE": 3, "MODE": 5, "BLOCK": BLOCK, "STREAM": 0}
    ptx = _hopper(ring_copy, _INTS, constants, tmp_path).asm["ptx"]
    assert "and.b64" in ptx and "4294967295" in ptx and "setp.gt.s64" in ptx, ptx[:2000]
    assert "atom.global.gpu.relaxed.max" not in ptx and ".max.s64" not in ptx


def test_the_batch_record_kernel_compiles_for_hopper_without_spills(tmp_path: Path) -> None:
    """sm_90 without a GPU: :func:`graph_record_batch` (24 entries' arguments) compiles to a cubin with no local
    memory or spills; its copies move 8-byte words."""
    from moereplay.capture.graph_ring_kernel import BATCH_INTS, BLOCK, FOLD, graph_record_batch

    ptx = _hopper(graph_record_batch, BATCH_INTS, {"BLOCK": BLOCK, "FOLD": FOLD}, tmp_path).asm["ptx"]
    assert "ld.global.b64" in ptx and "st.global.b64" in ptx


def test_the_compact_batch_kernel_compiles_for_hopper_small(tmp_path: Path) -> None:
    """sm_90 without a GPU: :func:`graph_record_batch_compact` is a cubin with no local memory or spills, a
    fraction of the unrolled batch kernel's code (3.7 MB with Triton 3.6: each program stepped over 48 far-apart
    bodies to reach its own); its copies move 8-byte words, and the last program takes the entries' partial words
    and stores their tag words as vectors."""
    from moereplay.capture.graph_ring_kernel import BATCH_INTS, BLOCK, FOLD, LANES, graph_record_batch_compact

    built = _hopper(
        graph_record_batch_compact, BATCH_INTS, {"BLOCK": BLOCK, "FOLD": FOLD, "LANES": LANES}, tmp_path
    )
    assert len(built.asm["cubin"]) < 512 << 10, len(built.asm["cubin"])
    ptx = built.asm["ptx"]
    assert "ld.global.b64" in ptx and "st.global.b64" in ptx
    assert "atom.global.gpu.relaxed.exch.b64" in ptx and "atom.global.gpu.relaxed.max.s64" in ptx, ptx[:2000]


@pytest.mark.parametrize("stage", [0, 1])
def test_graph_record_compiles_for_hopper_moving_whole_words(tmp_path: Path, stage: int) -> None:
    """sm_90 without a GPU: a cubin, no local memory or spills, and no byte-wide global access — every span
    moves as 8-byte words (the decode entry's odd-sized routing spans once made a whole node copy byte by byte)."""
    from moereplay.capture.graph_ring_kernel import BLOCK, FOLD, RECORD_INTS, STAGE_BLOCK, graph_record

    constants = {"BLOCK": STAGE_BLOCK if stage else BLOCK, "FOLD": FOLD, "STAGE": stage}
    built = _hopper(graph_record, RECORD_INTS, constants, tmp_path)
    ptx = built.asm["ptx"]
    assert not any(f"{op}.global.{width}" in ptx for op in ("ld", "st") for width in ("u8", "b8", "s8"))
    words = constants["BLOCK"]
    assert ptx.count("ld.global.b64") >= words // (32 * built.metadata.num_warps)  # a word per lane a step
    if stage:  # the staging copy on the graph's path: no atomic, no fence, no fold
        assert "atom." not in ptx and "fence" not in ptx and "membar" not in ptx, ptx[:2000]


def test_the_eager_ring_stores_streaming_only_when_asked() -> None:
    """sm_90 without a GPU: with ``STREAM`` (MOEREPLAY_FLIGHT_STREAM_STORES) every store into the ring is
    ``st.global.cs`` — the one plain store left is the finished word into host memory — and without it none is."""
    import inspect
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from moereplay.capture.ring_kernel import BLOCK, ring_copy

    names = list(inspect.signature(ring_copy.fn).parameters)
    for mode in (0, 3):  # copies only; copies with the fused check and the tag word
        for stream in (0, 1):
            constants = {"ALIGNED": 1, "CODE": 2, "MODE": mode, "BLOCK": BLOCK, "STREAM": stream}
            signature = {name: "constexpr" if name in constants else "i64" for name in names}
            built = compile(
                ASTSource(
                    ring_copy, signature, constexprs={(names.index(n),): v for n, v in constants.items()}
                ),
                target=GPUTarget("cuda", 90, 32),
            )
            stores = re.findall(r"st\.global[.\w:]*", built.asm["ptx"])
            streaming = sum(".cs" in store for store in stores)
            if stream:  # (mode 3: the host word's store stays plain)
                assert streaming and len(stores) - streaming == (1 if mode else 0), (
                    mode,
                    sorted(set(stores)),
                )
            else:
                assert stores and not streaming, (mode, sorted(set(stores)))
