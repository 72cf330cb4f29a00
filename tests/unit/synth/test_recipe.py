"""Recipes: a tensor recorded as a seeded generator call loads back as the very same tensor, and nothing else."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moereplay.synth  # noqa: F401 - registers the recipe codec
from moereplay.errors import CaptureFileError, UnsupportedValueError
from moereplay.format import CaptureReader, CaptureWriter
from moereplay.format.codecs import codec_for
from moereplay.format.schema import CodecValue
from moereplay.synth import recipe as recipes
from moereplay.synth.drawing import Drawer
from moereplay.synth.recipe import RECIPE_TYPE, TensorRecipe, expand, generate, recipe_for

WEIGHTS = {"seed": 3, "format": "nvfp4", "experts": 2, "size_k": 128, "size_n": 128, "bias": True}
SWIZZLED = {"seed": 4, "experts": 2, "k": 256, "n": 256, "num_warps": 8}


def write(path: Path, args: dict[str, object]) -> Path:
    with CaptureWriter(path) as writer:
        index = writer.begin_call("toy", args)
        writer.complete_call(index, {})
    return path


def test_a_recorded_recipe_loads_as_the_same_tensor_with_its_strides(tmp_path: Path) -> None:
    drawer = Drawer()
    weight = drawer.draw("marlin_experts", WEIGHTS, "b_qweight")
    storage = drawer.draw("hopper_mxfp4", SWIZZLED, "values")  # a transposed view, as triton_kernels keeps it
    assert storage.stride(-2) == 1
    recipe_w, recipe_s = drawer.recipe_of(weight), drawer.recipe_of(storage)
    assert recipe_w is not None and recipe_s is not None
    path = write(tmp_path / "r.moe.zst", {"w": recipe_w, "nested": {"s": [recipe_s]}})
    with CaptureReader(path) as reader:
        record = reader.call(0)
        assert isinstance(record.args["w"], CodecValue) and record.args["w"].type_name == RECIPE_TYPE
        assert (
            reader.stats().unique_blob_bytes == 0
        )  # only the recipes' empty anchors: no tensor bytes at all
        args = reader.load_args(0)
    assert torch.equal(args["w"], weight) and args["w"].dtype == torch.int32
    loaded = args["nested"]["s"][0]
    assert torch.equal(loaded, storage) and loaded.stride() == storage.stride()


def test_expansion_is_deterministic_and_matches_a_fresh_process(tmp_path: Path) -> None:
    recipe = recipe_for(
        generate("marlin_experts", WEIGHTS)["b_scales"], "marlin_experts", WEIGHTS, "b_scales"
    )
    recipes.clear_cache()
    first = expand(recipe)
    recipes.clear_cache()
    assert torch.equal(expand(recipe).view(torch.uint8), first.view(torch.uint8))
    script = (
        "import moereplay.synth.recipe as r\n"
        f"print(r.tensor_digest(r.generate('marlin_experts', {WEIGHTS!r})['b_scales']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == recipe.sha256


def test_a_strided_tensor_is_hashed_in_pieces_as_one_row_major_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [
        torch.randn(3, 40, 50).transpose(1, 2),
        torch.randn(1, 1, 300, 7).mT,
        torch.randint(0, 255, (7, 9, 11), dtype=torch.uint8).permute(2, 0, 1),
        torch.randn(1000, 3)[::2],
        torch.randn(2, 3000).t(),
    ]
    whole = [recipes.tensor_digest(t.contiguous()) for t in tensors]
    monkeypatch.setattr(recipes, "_DIGEST_PIECE", 1000)
    assert [recipes.tensor_digest(t) for t in tensors] == whole


def test_the_digest_a_generator_hashed_while_writing_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A generator may hand over the digests it worked out as it wrote a part; the first expansion checks that one
    (a wrong one fails like wrong bytes), the next expansions hash the tensor again."""
    params = {"seed": 0, "shape": [8, 8]}
    values = recipes.generate("normal", {"seed": 0, "shape": [8, 8]})[""].clone()
    recipe = recipe_for(values, "toy_hashed", params)
    claimed = {"digest": "0" * 64}

    def toy(given: object) -> recipes.Drawn:
        return recipes.Drawn({"": values.clone()}, {"": (claimed["digest"], claimed["digest"])})

    monkeypatch.setitem(recipes._GENERATORS, "toy_hashed", toy)
    monkeypatch.setenv("MOEREPLAY_CACHE_DIR", "off")
    recipes.clear_cache()
    with pytest.raises(CaptureFileError, match="different bytes"):
        expand(recipe)
    assert torch.equal(expand(recipe), values)  # the claim is used once: the cached tensor is hashed now
    recipes.clear_cache()
    claimed["digest"] = recipe.sha256
    assert torch.equal(expand(recipe), values)


def test_a_recipe_whose_bytes_differ_from_its_digest_is_refused() -> None:
    recipe = recipe_for(
        generate("normal", {"seed": 1, "shape": [4, 4]})[""], "normal", {"seed": 1, "shape": [4, 4]}
    )
    tampered = dataclasses.replace(recipe, sha256="0" * 64)
    with pytest.raises(CaptureFileError, match="different bytes"):
        expand(tampered)
    assert torch.equal(expand(tampered, verify=False), expand(recipe))


def test_unknown_generators_parts_and_shapes_are_refused_in_one_line() -> None:
    base = recipe_for(generate("normal", {"seed": 1, "shape": [4]})[""], "normal", {"seed": 1, "shape": [4]})
    with pytest.raises(CaptureFileError, match="unknown to this moereplay"):
        expand(dataclasses.replace(base, generator="nope"))
    with pytest.raises(CaptureFileError, match="no output 'b_qweight'"):
        expand(dataclasses.replace(base, part="b_qweight"))
    with pytest.raises(CaptureFileError, match="recorded float32\\[5\\]"):
        expand(dataclasses.replace(base, shape=(5,)))


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ([], "not a map"),
        ({"v": 99}, "version"),
        ({"v": 1, "generator": 1, "part": "", "dtype": "int32"}, "not text"),
        ({"v": 1, "generator": "normal", "part": "", "dtype": "os", "sha256": "0" * 64, "params": {}}, "torch dtype"),
        (
            {"v": 1, "generator": "normal", "part": "", "dtype": "int32", "sha256": "0" * 64, "params": {},
             "shape": [1, -2], "stride": [1, 1]},
            "non-negative",
        ),
    ],
)  # fmt: skip
def test_malformed_recipe_trees_raise_unsupported_value(tree: object, message: str) -> None:
    with pytest.raises(UnsupportedValueError, match=message):
        recipes.recipe_from_tree(tree)


def test_importing_the_recipe_module_registers_its_codec() -> None:
    assert codec_for(RECIPE_TYPE) is not None
    assert f"{TensorRecipe.__module__}.{TensorRecipe.__qualname__}" == RECIPE_TYPE


def test_normal_generator_zeroes_the_padding_columns() -> None:
    values = generate("normal", {"seed": 2, "shape": [3, 8], "dtype": "bfloat16", "zero_from": 5})[""]
    assert values.dtype == torch.bfloat16
    assert bool((values[:, 5:] == 0).all()) and bool((values[:, :5] != 0).all())


def _budget_asked(path: Path, environ: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> int:
    """The bytes the reader says call 0's arguments need (a 1-byte budget refuses before anything is drawn)."""
    import re

    from moereplay.errors import MemoryBudgetError
    from moereplay.format import CaptureReader

    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with CaptureReader(path, memory_budget=1) as reader, pytest.raises(MemoryBudgetError) as refused:
        reader.load_args(0)
    match = re.search(r"need ([\d,]+) bytes", str(refused.value))
    assert match is not None
    return int(match.group(1).replace(",", ""))


def test_the_memory_budget_counts_one_draw_per_weight_set_not_one_per_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundled gemm1 capture expands with a 3.5 GB peak (its four recipe parts come from one draw): the
    reader must ask for about that, not 52 GB (four parts each charged the whole draw, at 24 B per element),
    which refused every bundled gpt-oss capture on a 24 GB machine."""
    capture = Path(__file__).resolve().parents[3] / "captures" / "marlin-nvfp4-gpt-oss-gemm1.moe.zst"
    asked = _budget_asked(capture, {"MOEREPLAY_CACHE_DIR": "off"}, monkeypatch)
    assert 3 * 10**9 < asked < 8 * 10**9
    # with every part kept on disk nothing is drawn: only the kept tensors count
    empty = tmp_path / "store"
    asked_with_store = _budget_asked(capture, {"MOEREPLAY_CACHE_DIR": str(empty)}, monkeypatch)
    assert asked_with_store == asked  # an empty store keeps nothing
