"""Cheap cache keys must never serve a stale entry: content digests remembered per tensor object are recomputed
after an in-place change (and never handed to another tensor that reuses a dead one's id); re-derived routing is
keyed by what the op's ``rederive`` reads; rounding allowances by the reference and the launch values they read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moereplay.ops.marlin_moe import MARLIN_MOE, rederive_alignment
from moereplay.reference.tolerance import op_error_allowance
from moereplay.replay import ReplaySession
from moereplay.replay.memo import _DIGESTS, ArgsCache, args_key, tensor_key
from moereplay.replay.mutations import apply_variant, parse_variants
from moereplay.replay.source import clear_call_cache


def test_a_content_key_is_hashed_once_per_tensor_version() -> None:
    tensor = torch.arange(16, dtype=torch.int32)
    key = tensor_key(tensor)[0]
    hashed = _DIGESTS.hashed
    assert tensor_key(tensor)[0] == key and _DIGESTS.hashed == hashed  # remembered
    assert tensor_key(tensor.clone())[0] == key  # another object, same bytes: same key (hashed once more)
    tensor.add_(1)  # in place: same object, new version
    changed = tensor_key(tensor)[0]
    assert changed != key and changed == tensor_key(torch.arange(1, 17, dtype=torch.int32))[0]
    tensor.sub_(1)
    assert tensor_key(tensor)[0] == key  # hashed again: the bytes are the first ones once more
    assert tensor_key(tensor.view(4, 4))[0] != key  # another layout


def test_a_dead_tensors_digest_is_never_served_to_a_new_one() -> None:
    for value in range(
        200
    ):  # CPython reuses a freed object's id at once: the new tensor must not get its key
        tensor = torch.full((8,), value, dtype=torch.int64)
        key = tensor_key(tensor)[0]
        assert key == tensor_key(torch.full((8,), value, dtype=torch.int64))[0]
        del tensor
    before = len(_DIGESTS)
    made = [torch.full((4,), i) for i in range(10)]
    for tensor in made:
        tensor_key(tensor)
    assert len(_DIGESTS) >= before + 10
    del made, tensor
    assert (
        len(_DIGESTS) <= before + 1
    )  # dead tensors leave the table (the list's last element was still named)


@pytest.fixture(scope="module")
def marlin_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moereplay.synth import synthesize

    path = tmp_path_factory.mktemp("keys") / "marlin.moe.zst"
    settings = ["tokens=4", "experts=4", "n=128", "k=256", "block_size=16"]
    synthesize("marlin-nvfp4-report", path, overrides=settings, store="bytes")
    return path


def _session(path: Path) -> ReplaySession:
    clear_call_cache()
    return ReplaySession(path, backend="reference", device="cpu")


def test_marlin_rederive_reads_only_its_declared_inputs(marlin_capture: Path) -> None:
    with _session(marlin_capture) as session:
        args = session.call.args
        declared = {name: args[name] for name in MARLIN_MOE.derivation_inputs}
        for block in (8, 32, 64):
            full = rederive_alignment({**args, "moe_block_size": block}, block)
            restricted = rederive_alignment({**declared, "moe_block_size": block}, block)
            assert full.keys() == restricted.keys()
            assert all(torch.equal(full[name], restricted[name]) for name in full)


def test_rederived_routing_is_shared_across_launch_flags_and_a_changed_input_misses(
    marlin_capture: Path,
) -> None:
    with _session(marlin_capture) as session:
        args: dict[str, Any] = dict(session.call.args)
        cache: ArgsCache[dict[str, Any]] = ArgsCache()

        def applied(spec: str, call: dict[str, Any]) -> dict[str, Any]:
            (variant,) = parse_variants(MARLIN_MOE, [spec])
            result = apply_variant(MARLIN_MOE, call, variant, derived_cache=cache)
            assert result.invalid_reason is None
            plain = apply_variant(MARLIN_MOE, call, variant)  # no cache: what the cached one must equal
            for name in ("sorted_token_ids", "expert_ids", "num_tokens_past_padded"):
                assert torch.equal(result.args[name], plain.args[name])
            return result.args

        first = applied("set moe_block_size=32", args)
        assert (cache.misses, cache.hits) == (1, 0)
        flags = applied("set moe_block_size=32+use_atomic_add=true+use_fp32_reduce=false", args)
        assert (cache.misses, cache.hits) == (1, 1)
        assert flags["sorted_token_ids"] is first["sorted_token_ids"]
        applied("set moe_block_size=64", args)
        assert cache.misses == 2
        # the captured routing changes in place (same tensor objects, new version): never the old answer
        args["sorted_token_ids"] = args["sorted_token_ids"].clone()
        again = applied("set moe_block_size=32", args)  # a new object with the same bytes: the same key
        assert cache.misses == 2 and again["sorted_token_ids"] is first["sorted_token_ids"]
        rows = int(args["size_m"]) * int(args["top_k"])
        valid = args["sorted_token_ids"] < rows
        args["sorted_token_ids"][valid] = args["sorted_token_ids"][valid].flip(0)  # rows moved between blocks
        moved = applied("set moe_block_size=32", args)
        assert cache.misses == 3 and not torch.equal(moved["sorted_token_ids"], first["sorted_token_ids"])


def test_allowances_are_keyed_by_reduction_mode_and_tile(marlin_capture: Path) -> None:
    with _session(marlin_capture) as session:
        args = dict(session.call.args)
        reference = session.reference_for(args)
        cache = session._memos.allowances

        def allowance(**changes: Any) -> Any:
            call = {**args, **changes}
            got = session.allowance_for(call, reference, torch.bfloat16)
            fresh = op_error_allowance(MARLIN_MOE, call, reference, torch.bfloat16)
            assert (got is None) == (fresh is None)
            if got is not None:
                assert torch.equal(got.absolute, fresh.absolute) and got.label == fresh.label
            return got

        assert allowance() is None
        atomic = allowance(use_atomic_add=True)
        misses = cache.misses
        # thread_n, blocks per SM, is_k_full: not read by the bound — the same entry
        assert allowance(use_atomic_add=True, thread_n=64, blocks_per_sm=2, is_k_full=False) is atomic
        assert cache.misses == misses
        tiled = allowance(use_atomic_add=True, thread_k=128, thread_n=64)  # another K tile: another bound
        reduced = allowance(use_fp32_reduce=False)  # another mode
        assert cache.misses == misses + 2
        assert tiled is not atomic and reduced is not atomic and tiled.label != atomic.label
        # another reference (the routing weights changed): a miss even with the same launch values
        weights = args["topk_weights"] * 2
        other = session.reference_for({**args, "topk_weights": weights})
        key = args_key({**args, "topk_weights": weights}, MARLIN_MOE.reference_ignores)
        doubled = session.allowance_for(
            {**args, "topk_weights": weights, "use_atomic_add": True}, other, torch.bfloat16, key
        )
        assert doubled is not atomic and not torch.equal(doubled.absolute, atomic.absolute)
