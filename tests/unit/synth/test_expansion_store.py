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
