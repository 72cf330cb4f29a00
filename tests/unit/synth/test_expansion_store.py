"""Expanded recipes kept on disk: the next process reads them back (no drawing), bit for bit, and a damaged or
foreign entry is never used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moereplay.synth import expansion_store
from moereplay.synth import recipe as recipes
from moereplay.synth.recipe import expand, generate, recipe_for

SWIZZLED = {"seed": 5, "experts": 2, "k": 256, "n": 256, "num_warps": 8}


def _recipe() -> recipes.TensorRecipe:
    values = generate("hopper_mxfp4", SWIZZLED)["values"]  # a transposed view: the store keeps storage order
    return recipe_for(values, "hopper_mxfp4", SWIZZLED, "values")


def test_a_verified_expansion_is_read_back_without_drawing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOEREPLAY_CACHE_DIR", str(tmp_path))
    recipe = _recipe()
    recipes.clear_cache()
    first = expand(recipe)
    expansion_store.flush()  # written in the background
    assert len(list(tmp_path.glob("*.bin"))) == 1
    recipes.clear_cache()

    def no_drawing(generator: str, params: object) -> None:
        raise AssertionError("the stored expansion was not used")

    monkeypatch.setattr(recipes, "generate", no_drawing)
    again = expand(recipe)
    assert torch.equal(again, first) and again.stride() == first.stride() == recipe.stride


def test_a_damaged_entry_is_dropped_and_the_recipe_drawn_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOEREPLAY_CACHE_DIR", str(tmp_path))
    recipe = _recipe()
    first = expand(recipe)
    expansion_store.flush()
    (entry,) = tmp_path.glob("*.bin")
    raw = bytearray(entry.read_bytes())
    raw[0] ^= 0xFF
    entry.write_bytes(bytes(raw))
    assert expansion_store.load(recipe.sha256, first.dtype, recipe.shape, recipe.stride) is None
    assert not entry.exists()
    recipes.clear_cache()
    assert torch.equal(expand(recipe), first)


def test_the_store_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEREPLAY_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expand(_recipe())
    assert expansion_store.store_directory() is None and not list(tmp_path.rglob("*.bin"))
    assert (
        expansion_store.store_directory({"XDG_CACHE_HOME": str(tmp_path)})
        == tmp_path / "moereplay" / "recipes"
    )


def test_a_kept_expansion_is_handed_over_and_the_next_one_reads_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the store on, the first expansion hands over the drawn tensor itself (no copy), the next reads the store:
    two tensors that share nothing, and the generator's other parts are still all there for whoever asks."""
    monkeypatch.setenv("MOEREPLAY_CACHE_DIR", str(tmp_path))
    recipe = _recipe()
    recipes.clear_cache()
    first = expand(recipe)
    pristine = first.clone()
    first[0, 0, :8] = 0x55  # the caller owns it: nothing else sees this
    second = expand(recipe)
    assert torch.equal(second, pristine) and second.stride() == pristine.stride()
    assert second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    second[0, 0, :8] = 0xAA  # a private mapping of the kept file: writes stay in this process
    assert torch.equal(expand(recipe), pristine)
    whole = generate("hopper_mxfp4", SWIZZLED)
    assert set(whole) == {"values", "scales"} and torch.equal(whole["values"], pristine)


def test_without_the_store_every_expansion_is_a_fresh_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEREPLAY_CACHE_DIR", "off")
    recipe = _recipe()
    first = expand(recipe)
    pristine = first.clone()
    first[0, 0, :8] = 0x55
    assert torch.equal(expand(recipe), pristine)
    assert torch.equal(generate("hopper_mxfp4", SWIZZLED)["values"], pristine)


def test_a_background_write_is_waited_for_and_checked_against_the_bytes_as_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOEREPLAY_CACHE_DIR", str(tmp_path))
    kept = torch.arange(4096, dtype=torch.int32).reshape(64, 64)
    digest = recipes.tensor_digest(kept)
    assert expansion_store.save(digest, kept, checksum=digest, background=True)
    loaded = expansion_store.load(digest, kept.dtype, (64, 64), (64, 1))  # waits for the write
    assert loaded is not None and torch.equal(loaded, kept)

    changed = kept.t().contiguous().t()  # strided: its storage checksum is worked out before save returns
    real_write = expansion_store._write

    def owner_changes_it_first(*args: object) -> bool:
        changed[0, 0] = -1
        return real_write(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(expansion_store, "_write", owner_changes_it_first)
    other = recipes.tensor_digest(changed)
    assert expansion_store.save(other, changed, background=True)
    assert expansion_store.load(other, changed.dtype, (64, 64), (1, 64)) is None  # refused and dropped
    assert not list(tmp_path.glob(f"{other}-int32-64x64-1x64.*"))
