"""What makes a sweep fast must not change what a replay concludes: pooled guarded buffers are rewritten before
every run, references are cached only by what changes them, and a reloaded call is the same call only while nothing
changed. Real toy kernels (tests/unit/replay/replay_toy.py) that scribble where they must not; this file is also
their backend (``python:<this file>#<kernel>``)."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the worker imports this file by path
import replay_toy as toy

from moereplay.ops.base import KernelBackend
from moereplay.replay import GuardStatus, ReplaySession, Verdict, replay
from moereplay.replay.backends import ModuleBackend
from moereplay.replay.memo import CONTENT_KEY_BYTES, args_key, memos_for
from moereplay.replay.memory import BufferPool, materialise
from moereplay.replay.mutations import DEFAULT_FILL, FillPattern, Variant, apply_variant, parse_variants
from moereplay.replay.source import clear_call_cache, load_call_cached

THIS_FILE = os.path.abspath(__file__)


def _scribbling_kernel(args: dict[str, Any]) -> torch.Tensor:
    """The correct toy kernel, then: with ``block == 2`` it adds 1 to every weight of ``w`` *inside* its span (after
    using them: its own output stays right); with ``block == 4`` it writes 8 bytes past the end of ``w``."""
    out = toy._kernel("correct", args)
    w = args["w"]
    if args["block"] == 2:
        w.add_(1.0)
    if args["block"] == 4:
        raw = torch.empty(0, dtype=torch.uint8, device=w.device).set_(w.untyped_storage())
        end = (w.storage_offset() + w.numel()) * w.element_size()
        raw[end : end + 8] = 0xCD
    return out


def backend(device: torch.device, name: str) -> KernelBackend:
    module = types.ModuleType("toy_kernels")
    module.scaled_rows = _scribbling_kernel  # type: ignore[attr-defined]
    return ModuleBackend.of_modules("toy:scribble", device, {"toy_kernels": module})


def capture(tmp_path: Path, name: str = "toy.moe.zst", **settings: Any) -> Path:
    return toy.write_capture(tmp_path / name, toy.make_args(**settings))


def judge_sequence(path: Path, isolate: bool) -> list[tuple[str, Verdict, GuardStatus, bool | None]]:
    specs = ["set block=2", "set block=4", "flip mul_weights", "set block=1"]
    with ReplaySession(
        path, backend=f"python:{THIS_FILE}#scribble", device="cpu", isolate=isolate
    ) as session:
        rows = [(session.baseline.label, session.baseline.verdict, session.baseline.result.guard, None)]
        for spec in specs:
            result = session.run(spec).result
            rows.append((result.label, result.verdict, result.guard, result.bit_exact))
        if not isolate:
            pool = session.runner.pool  # type: ignore[union-attr]
            assert pool.reused >= 4, "the runs after the first reuse their allocations"
    return rows


def expected_rows() -> list[tuple[str, Verdict, GuardStatus, bool | None]]:
    return [
        ("baseline", Verdict.OK, GuardStatus.CLEAN, None),
        ("set block=2", Verdict.OK, GuardStatus.CLEAN, True),  # its scribble inside w's span is after its use
        ("set block=4", Verdict.CORRUPT, GuardStatus.DAMAGED, True),  # the guard write is caught
        # the run after a scribble sees pristine w and clean guards: a leak would make these wrong or damaged
        ("flip mul_weights", Verdict.OK, GuardStatus.CLEAN, False),
        ("set block=1", Verdict.OK, GuardStatus.CLEAN, True),
    ]


def test_pooled_buffers_start_every_run_fresh_in_process(tmp_path: Path) -> None:
    assert judge_sequence(capture(tmp_path), isolate=False) == expected_rows()


def test_pooled_buffers_start_every_run_fresh_in_the_worker(tmp_path: Path) -> None:
    assert judge_sequence(capture(tmp_path), isolate=True) == expected_rows()


def test_a_reused_allocation_is_rewritten_entirely() -> None:
    pool = BufferPool()
    source = {"x": torch.arange(10, dtype=torch.float32)}
    first = materialise(source, "cpu", DEFAULT_FILL, guard=64, pool=pool)
    buffer = first.allocation_of("x").buffer
    buffer.fill_(0x5A)  # a kernel that wrote everywhere: span and both guards
    assert first.damage()
    first.release()
    second = materialise(source, "cpu", FillPattern(0xFF), guard=64, pool=pool)
    assert pool.reused == 1 and second.allocation_of("x").buffer.data_ptr() == buffer.data_ptr()
    assert torch.equal(second.args["x"], source["x"])
    assert second.damage() == []
    assert bool((second.allocation_of("x").buffer[:64] == 0xFF).all())


def test_the_reference_is_reused_only_for_what_the_op_ignores(tmp_path: Path) -> None:
    path = capture(tmp_path)
    clear_call_cache()
    with ReplaySession(path, backend=toy.spec("correct"), device="cpu", isolate=False) as session:
        cache = memos_for(session.call).references
        assert session.baseline.verdict is Verdict.OK
        assert (cache.misses, cache.hits) == (1, 0)
        assert session.run("set block=2").verdict is Verdict.OK  # 'block' is in reference_ignores
        assert (cache.misses, cache.hits) == (1, 1)
        # a flag flip and a cast change the reference: a stale one would judge these correct outputs corrupt
        assert session.run("flip mul_weights").verdict is Verdict.OK
        assert (
            session.run("cast weights=bfloat16").verdict is Verdict.CORRUPT
        )  # read as float32: the real bug
        assert (cache.misses, cache.hits) == (3, 1)
        loaded = session.call
    with ReplaySession(path, backend=toy.spec("correct"), device="cpu", isolate=False) as again:
        assert again.call is loaded  # same file, nothing changed: the loaded call and its caches are reused
        assert again.run("flip mul_weights").verdict is Verdict.OK
        assert (cache.misses, cache.hits) == (3, 3)


def test_a_changed_call_or_file_is_loaded_again(tmp_path: Path) -> None:
    path = capture(tmp_path)
    first = load_call_cached(path, 0)
    assert load_call_cached(path, 0) is first
    first.args["x"].add_(1.0)  # changed in place by some client: never served again
    second = load_call_cached(path, 0)
    assert second is not first and not torch.equal(second.args["x"], first.args["x"])
    toy.write_capture(path, toy.make_args(seed=1))  # rewritten in place, same size
    third = load_call_cached(path, 0)
    assert third is not second and not torch.equal(third.args["x"], second.args["x"])
    clear_call_cache()


def test_argument_keys_follow_content_for_small_tensors_and_identity_for_large_ones() -> None:
    small = torch.arange(8, dtype=torch.int32)
    assert args_key({"a": small})[0] == args_key({"a": small.clone()})[0]
    assert args_key({"a": small})[0] != args_key({"a": small.to(torch.int64)})[0]
    assert (
        args_key({"a": small, "b": 1}, frozenset({"b"}))[0]
        == args_key({"a": small, "b": 2}, frozenset({"b"}))[0]
    )
    large = torch.zeros(CONTENT_KEY_BYTES // 4 + 1)
    key, pins = args_key({"w": large})
    assert pins == (large,) and key != args_key({"w": large.clone()})[0]
    large.add_(1.0)
    assert args_key({"w": large})[0] != key  # an in-place change bumps the version


def test_marlin_block_size_sweep_rederives_once_per_size_and_judges_as_before(tmp_path: Path) -> None:
    from moereplay.ops.marlin_moe import MARLIN_MOE
    from moereplay.synth import synthesize

    path = tmp_path / "marlin.moe.zst"
    settings = ["tokens=4", "experts=4", "n=64", "k=128", "block_size=16"]
    synthesize("marlin-nvfp4-report", path, overrides=settings, store="bytes")
    sweep = ["sweep moe_block_size=8,32,64", "set moe_block_size=8+thread_k=64+thread_n=128"]
    clear_call_cache()
    first = replay(path, mutations=sweep, backend="reference", device="cpu")
    loaded = load_call_cached(path, 0)
    derived = memos_for(loaded).derived
    assert derived.hits == 0 and derived.misses >= 3  # one re-derivation per distinct block size (and tile)
    misses = derived.misses
    second = replay(path, mutations=sweep, backend="reference", device="cpu")  # same loaded call, same caches
    assert derived.misses == misses and derived.hits == misses
    (variant,) = parse_variants(MARLIN_MOE, ["set moe_block_size=8"])
    cached = apply_variant(MARLIN_MOE, loaded.args, variant, derived_cache=derived)
    plain = apply_variant(MARLIN_MOE, loaded.args, variant)
    for name in ("sorted_token_ids", "expert_ids", "num_tokens_past_padded"):
        assert torch.equal(cached.args[name], plain.args[name])
    clear_call_cache()
    fresh = replay(path, mutations=sweep, backend="reference", device="cpu")  # nothing cached
    for report in (second, fresh):
        assert [r.to_json() for r in first.results] == [r.to_json() for r in report.results]
        assert [f.to_json() for f in first.findings] == [f.to_json() for f in report.findings]
    assert isinstance(variant, Variant)
