"""A codec's one-pass ``collect`` (what the layer-scope flight recorder runs on the serving thread) gives exactly
what encoding and then walking the encoded tree gives: the same tree, the same tensors in the same order."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moereplay.capture.snapshot import _Pending, _walk, format_codec
from moereplay.format.schema import CodecValue
from moereplay.ops import (
    matmul_ogs,  # noqa: F401  (registers the triton_kernels codecs)
    ogs_codecs,
)


def _ints(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32)


def _routing(**changes: Any) -> ogs_codecs.RoutingSpec:
    expt = ogs_codecs.ExptDataSpec(
        hist=_ints(4),
        token_offs_raw=_ints(5),
        token_offs_pad={64: _ints(5), 16: _ints(5), 32: _ints(5)},  # unsorted keys: the tree sorts them
        block_pid_map={16: _ints(9), 64: _ints(7), 32: _ints(8)},
    )
    fields: dict[str, Any] = {
        "gate_scal": torch.rand(8),
        "expt_hist": _ints(4),
        "n_expts_tot": 4,
        "n_expts_act": 2,
        "expt_data": expt,
        "expected_tokens_per_expt": None,
    }
    fields.update(changes)
    return ogs_codecs.RoutingSpec(**fields)


def _normal(tree: Any, found: list[torch.Tensor]) -> Any:
    """The tree with each placeholder as the id of its tensor (placeholders differ as objects)."""
    if isinstance(tree, _Pending):
        return ("tensor", id(found[tree.index]))
    if isinstance(tree, CodecValue):
        return ("codec", tree.type_name, _normal(tree.value, found))
    if isinstance(tree, dict):
        return {key: _normal(value, found) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return [type(tree).__name__, *(_normal(value, found) for value in tree)]
    return tree


CASES = {
    "routing": _routing(),
    "routing without expt_data": _routing(expt_data=None),
    "routing without gate_scal, expected tokens": _routing(gate_scal=None, expected_tokens_per_expt=7),
    "routing without block maps": _routing(expt_data=ogs_codecs.ExptDataSpec(_ints(4), None, None, None)),
    "gather": ogs_codecs.GatherSpec(_ints(8), _ints(8)),
    "scatter": ogs_codecs.ScatterSpec(_ints(8), _ints(8)),
    "a list of them": [ogs_codecs.GatherSpec(_ints(8), _ints(8)), _routing(), 3, None],
    "nested past the depth limit": [[[[[[_routing()]]]]]],  # the walk's MAX_DEPTH cuts inside the tree
}


@pytest.mark.parametrize("name", list(CASES))
def test_collect_equals_encode_then_walk(name: str) -> None:
    value = CASES[name]
    codec = format_codec(type(value)) if not isinstance(value, list) else None
    assert isinstance(value, list) or codec is not None
    fast: list[torch.Tensor] = []
    tree = _walk(value, fast, format_codec, 0)  # the registry's codecs have ``collect``: one pass

    def no_collect(kind: type) -> Any:  # another lookup function: the generic encode-then-walk path
        return format_codec(kind)

    slow: list[torch.Tensor] = []
    expected = _walk(value, slow, no_collect, 0)
    assert [id(t) for t in fast] == [id(t) for t in slow]
    assert _normal(tree, fast) == _normal(expected, slow)


def test_collect_refuses_what_encode_refuses() -> None:
    bad = ogs_codecs.GatherSpec(_ints(8), "not a tensor")  # type: ignore[arg-type]
    with pytest.raises(Exception, match=r"GatherIndx\.dst_indx is not a tensor"):
        _walk(bad, [], format_codec, 0)
