"""Tensors round-trip bit-exactly: every dtype, random shapes/strides/offsets, aliasing within a call."""

from __future__ import annotations

import math
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from capture_file_helpers import element_bytes, same_storage, view_over
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moereplay.format import CaptureReader, CaptureWriter, TensorBytes, Unsupported
from moereplay.format.tensors import DTYPES

QUANTIZED = {"qint8", "qint32", "quint8", "quint4x2", "quint2x4"}
ROUND_TRIP_DTYPES = sorted(name for name in DTYPES if name not in QUANTIZED)
REQUIRED = {
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bfloat16",
    "uint8",
    "int32",
    "int64",
    "bool",
}
STORAGE_BYTES = 1024


def test_every_required_dtype_is_covered() -> None:
    assert set(ROUND_TRIP_DTYPES) >= REQUIRED


@st.composite
def views(draw: st.DrawFn, storage: torch.Tensor) -> torch.Tensor:
    dtype = DTYPES[draw(st.sampled_from(ROUND_TRIP_DTYPES))]
    itemsize = dtype.itemsize
    rank = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank))
    stride = draw(st.lists(st.integers(0, 5), min_size=rank, max_size=rank))
    extent = (
        0
        if math.prod(shape) == 0
        else 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    )
    offset = draw(st.integers(0, STORAGE_BYTES // itemsize - extent))
    return view_over(storage, dtype, shape, stride, offset)


@st.composite
def calls(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor]]:
    """Argument tensors over 1-3 random storages, the storages, and outputs that reuse some of them."""
    storages = []
    args: dict[str, torch.Tensor] = {}
    for storage_number in range(draw(st.integers(1, 3))):
        seed = draw(st.integers(0, 2**31))
        storage = torch.randint(
            0, 256, (STORAGE_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
        )
        storages.append(storage)
        for view_number in range(draw(st.integers(1, 3))):
            args[f"s{storage_number}v{view_number}"] = draw(views(storage))
    outputs = {f"out_{name}": args[name] for name in draw(st.sets(st.sampled_from(sorted(args)), max_size=2))}
    return args, storages, outputs


def _check_same(loaded: torch.Tensor, original_bytes: torch.Tensor, original: torch.Tensor) -> None:
    assert loaded.dtype == original.dtype
    assert loaded.shape == original.shape
    assert loaded.stride() == original.stride()
    assert torch.equal(element_bytes(loaded), original_bytes)
    if original.numel():
        itemsize = original.element_size()
        assert (loaded.storage_offset() * itemsize) % 256 == (original.storage_offset() * itemsize) % 256


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_random_tensors_round_trip_with_aliasing(case) -> None:
    args, storages, outputs = case
    before = {name: element_bytes(tensor) for name, tensor in args.items()}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "t.zst"
        with CaptureWriter(path) as writer:
            index = writer.begin_call("op", args)
            for storage in storages:  # the "kernel" writes in place over every input storage
                storage.add_(1)
            writer.complete_call(index, outputs)
        after = {name: element_bytes(tensor) for name, tensor in outputs.items()}
        with CaptureReader(path) as reader:
            record = reader.call(index)
            loaded = reader.load_args(index)
            loaded_outputs = reader.load_outputs(index)
    for name, tensor in args.items():
        _check_same(loaded[name], before[name], tensor)
    for name, tensor in outputs.items():
        _check_same(loaded_outputs[name], after[name], tensor)
    names = sorted(args)
    for first in names:
        for second in names:
            if args[first].numel() and args[second].numel():
                shared = same_storage(args[first], args[second])
                assert same_storage(loaded[first], loaded[second]) == shared
                assert (record.arg_tensors[first].storage == record.arg_tensors[second].storage) == shared
    for name, tensor in outputs.items():
        if tensor.numel():
            aliased = record.aliases()[name]
            assert name.removeprefix("out_") in aliased
            assert all(same_storage(args[other], tensor) for other in aliased)


def _round_trip(tensors: dict[str, object], tmp_path: Path) -> dict[str, object]:
    path = tmp_path / "one.zst"
    with CaptureWriter(path) as writer:
        writer.begin_call("op", tensors)
    with CaptureReader(path) as reader:
        return reader.load_args(0)


def test_transposed_strided_expanded_and_zero_dim_views(tmp_path: Path) -> None:
    base = torch.arange(7 * 9, dtype=torch.float32).reshape(7, 9)
    cases = {
        "transposed": base.t(),
        "stepped": base[1::2, ::3],
        "expanded": torch.arange(3.0)[:, None].expand(3, 5),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.int64),
        "empty_offset": base.flatten()[10:10],
        "column": base[:, 4],
    }
    loaded = _round_trip(cases, tmp_path)
    for name, tensor in cases.items():
        _check_same(loaded[name], element_bytes(tensor), tensor)
    assert same_storage(loaded["transposed"], loaded["stepped"]) and same_storage(
        loaded["stepped"], loaded["column"]
    )
    assert loaded["expanded"].stride() == (1, 0)


def test_span_is_stored_not_a_contiguous_copy(tmp_path: Path) -> None:
    big = torch.zeros(1000, 1000, dtype=torch.float32)
    column = big[:, 0]  # 1000 elements spread over ~4 MB of storage
    path = tmp_path / "span.zst"
    with CaptureWriter(path) as writer:
        writer.begin_call("op", {"column": column, "row": big[3, :10]})
    with CaptureReader(path) as reader:
        stats = reader.stats()
        loaded = reader.load_args(0)
    assert stats.unique_blob_bytes == (999 * 1000 + 1) * 4  # first to last element touched, one storage
    assert loaded["column"].stride() == (1000,)
    assert same_storage(loaded["column"], loaded["row"])


def test_conjugate_view_round_trips(tmp_path: Path) -> None:
    tensor = torch.randn(4, dtype=torch.complex64)
    loaded = _round_trip({"z": tensor.conj()}, tmp_path)
    assert loaded["z"].is_conj()
    assert torch.equal(loaded["z"].resolve_conj(), tensor.conj().resolve_conj())


def test_unrecordable_tensors_become_unsupported(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    values = {
        "quantized": quantized,
        "meta": torch.empty(3, device="meta"),
        "sparse": torch.eye(3).to_sparse(),
        "negative": torch._neg_view(torch.randn(3)),
    }
    loaded = _round_trip(values, tmp_path)
    for name in values:
        assert isinstance(loaded[name], Unsupported), name
        assert loaded[name].type_name == "torch.Tensor"


def test_inplace_output_aliases_its_input(tmp_path: Path) -> None:
    hidden = torch.randn(4, 8)
    path = tmp_path / "inplace.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call("op", {"hidden_states": hidden, "scale": torch.ones(8)})
        hidden.mul_(2)
        writer.complete_call(index, {"out": hidden, "fresh": torch.zeros(2)})
    with CaptureReader(path) as reader:
        record = reader.call(index)
        assert record.aliases() == {"out": ("hidden_states",)}
        assert torch.equal(reader.load_args(index)["hidden_states"] * 2, reader.load_outputs(index)["out"])


def test_tensor_bytes_given_by_the_caller(tmp_path: Path) -> None:
    """A capture layer that copied the bytes itself keeps original offsets, aliasing and static reuse."""
    original = torch.arange(64, dtype=torch.int16)
    data = original.view(torch.uint8)[32:96].clone()  # bytes [32, 96) of the original storage
    weight = torch.randint(0, 255, (512,), dtype=torch.uint8)

    def given(offset: int, shape: tuple[int, ...], *, key: object = "x", static: bool = False) -> TensorBytes:
        return TensorBytes(torch.int16, shape, (1,), offset, "cuda:0", key, 32, data)

    static_first = TensorBytes(torch.uint8, (512,), (1,), 0, "cuda:0", "w", 0, weight, static_key=("w", 1))
    static_again = TensorBytes(torch.uint8, (512,), (1,), 0, "cuda:0", "w", 0, None, static_key=("w", 1))
    path = tmp_path / "given.zst"
    with CaptureWriter(path) as writer:
        first = writer.begin_call("op", {"a": given(16, (8,)), "b": given(20, (4,)), "w": static_first})
        writer.complete_call(first, {"out": given(24, (2,))})
        second = writer.begin_call("op", {"w": static_again})
    with CaptureReader(path) as reader:
        record = reader.call(first)
        assert record.arg_tensors["a"].storage_offset == 16 and record.arg_tensors["a"].device == "cuda:0"
        assert record.aliases() == {"out": ("a", "b")}
        loaded = reader.load_args(first)
        assert torch.equal(loaded["a"], original[16:24]) and torch.equal(loaded["b"], original[20:24])
        assert same_storage(loaded["a"], loaded["b"])
        assert torch.equal(reader.load_args(second)["w"], weight)
        assert reader.stats().blobs == 2


def test_tensor_bytes_outside_its_data_is_refused(tmp_path: Path) -> None:
    from moereplay.errors import UnsupportedValueError

    data = torch.zeros(8, dtype=torch.uint8)
    outside = TensorBytes(torch.int32, (4,), (1,), 0, "cpu", 1, 0, data)  # needs 16 bytes
    with CaptureWriter(tmp_path / "bad.zst") as writer, pytest.raises(UnsupportedValueError):
        writer.begin_call("op", {"x": outside})
