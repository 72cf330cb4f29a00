"""Aliasing as recorded: views of one storage share a storage id within a call's arguments and between its
arguments and outputs (``CallRecord.aliases()``), keep their original storage offsets, and load back as views of
one buffer — and a temporary freed before the kernel runs never makes a fresh output look like an alias."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from moereplay.capture import session as session_module
from moereplay.capture.patch_points import CaptureTarget
from moereplay.format import CaptureReader, register_codec, unregister_codec

MODULE = "moereplay_test_alias_kernels"


def scaled_copy(source: torch.Tensor, output: torch.Tensor, factor: float) -> torch.Tensor:
    """``output = source * factor`` in place (the two may be views of one workspace)."""
    output.copy_(source * factor)
    return output


def mixed_views(halves: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Reads a bfloat16 view and writes an int32 view of one byte buffer."""
    words.copy_(halves.float().sum().to(torch.int32).expand_as(words))
    return words


class Holder:
    """An opaque argument whose codec builds a temporary tensor (freed right after the snapshot)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data


def fresh(holder: Holder, count: int) -> torch.Tensor:
    """Returns a newly allocated tensor the size of the codec's temporary."""
    return torch.full((count,), 2.5)


HOLDER = f"{__name__}.Holder"


@pytest.fixture
def kernels(stand_in_module: Callable[..., types.ModuleType]) -> Iterator[types.ModuleType]:
    module = stand_in_module(MODULE, scaled_copy=scaled_copy, mixed_views=mixed_views, fresh=fresh)
    register_codec(HOLDER, lambda holder: {"scratch": holder.data * 1.0}, lambda tree: tree)
    try:
        yield module
    finally:
        session_module.disarm()
        unregister_codec(HOLDER)


TARGETS = (
    CaptureTarget("scaled_copy", "kernel", MODULE, "scaled_copy", outputs=("output",)),
    CaptureTarget("mixed_views", "kernel", MODULE, "mixed_views", outputs=("words",)),
    CaptureTarget("fresh", "kernel", MODULE, "fresh"),
)


@pytest.fixture
def armed(kernels: types.ModuleType, tmp_path: Path) -> session_module.Session:
    env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(tmp_path / "captures")}
    session = session_module.arm(env, targets=TARGETS)
    assert session is not None
    return session


def _close(session: session_module.Session) -> Path:
    assert session.flush()
    assert session.recorder.active, session.recorder.disabled_reason
    session.close()
    return session.path


def test_in_place_output_over_a_view_of_the_input_storage(armed, kernels: types.ModuleType) -> None:
    workspace = torch.arange(64, dtype=torch.float32)
    # gemm2 reading cache2 and writing cache3 of one workspace
    source, output = workspace[3:11], workspace[40:48]
    expected_workspace = workspace.clone()
    expected_workspace[40:48] = workspace[3:11] * 3.0
    kernels.scaled_copy(source, output, 3.0)
    assert torch.equal(workspace, expected_workspace)
    with CaptureReader(_close(armed)) as reader:
        record = reader.call(0)
        args, outputs = record.arg_tensors, record.output_tensors
        assert args["source"].storage == args["output"].storage == outputs["output"].storage
        assert (args["source"].storage_offset, args["output"].storage_offset) == (3, 40)
        assert outputs["output"].storage_offset == 40
        assert record.aliases() == {"output": ("source", "output")}
        loaded = reader.load_args(0)
        assert loaded["source"].untyped_storage().data_ptr() == loaded["output"].untyped_storage().data_ptr()
        assert loaded["output"].storage_offset() - loaded["source"].storage_offset() == 37
        assert torch.equal(loaded["source"], torch.arange(3, 11, dtype=torch.float32))
        assert torch.equal(loaded["output"], torch.arange(40, 48, dtype=torch.float32))
        assert torch.equal(reader.load_outputs(0)["output"], expected_workspace[40:48])
        # replaying from what was recorded gives the recorded output
        assert torch.equal(scaled_copy(loaded["source"], loaded["output"], 3.0), expected_workspace[40:48])


def test_views_of_other_dtypes_at_unaligned_offsets_share_one_storage(
    armed, kernels: types.ModuleType
) -> None:
    raw = torch.zeros(96, dtype=torch.uint8)
    halves = raw[2:18].view(torch.bfloat16)  # byte offset 2
    halves.copy_(torch.arange(8, dtype=torch.bfloat16))
    words = raw[40:56].view(torch.int32)  # byte offset 40: not a multiple of 4 past byte 2
    kernels.mixed_views(halves, words)
    with CaptureReader(_close(armed)) as reader:
        record = reader.call(0)
        assert record.arg_tensors["halves"].storage == record.arg_tensors["words"].storage
        assert record.aliases() == {"words": ("halves", "words")}
        loaded = reader.load_args(0)
        assert torch.equal(loaded["halves"], torch.arange(8, dtype=torch.bfloat16))
        assert torch.equal(loaded["words"], torch.zeros(4, dtype=torch.int32))
        for tensor in loaded.values():  # the original data-pointer alignment modulo 256 bytes survives
            original = halves if tensor.dtype == torch.bfloat16 else words
            assert (tensor.data_ptr() - tensor.untyped_storage().data_ptr()) % 256 == (
                original.data_ptr() - original.untyped_storage().data_ptr()
            ) % 256
        assert torch.equal(reader.load_outputs(0)["words"], torch.full((4,), 28, dtype=torch.int32))


def test_a_freed_codec_temporary_does_not_alias_a_fresh_output(armed, kernels: types.ModuleType) -> None:
    holder = Holder(torch.ones(1000))
    for _ in range(3):
        result = kernels.fresh(holder, 1000)
        assert torch.equal(result, torch.full((1000,), 2.5))
    with CaptureReader(_close(armed)) as reader:
        for record in reader.calls():
            assert "holder<Holder>.scratch" in record.arg_tensors
            assert record.aliases() == {}, record.aliases()
            assert torch.equal(reader.load_outputs(record.index)["return"], torch.full((1000,), 2.5))


def test_snapshot_copies_share_one_buffer_with_aligned_spans() -> None:
    from moereplay.capture.snapshot import TensorCopy, snapshot

    workspace = torch.arange(100, dtype=torch.float32)
    values = {
        "a": workspace[5:17],
        "b": workspace[60:70].view(torch.int32),
        "c": torch.arange(7, dtype=torch.int16),
        "d": torch.randn(3, 4).t(),  # a transposed view keeps its strides
        "n": 4,
    }
    taken = snapshot(values)
    copies = {name: value for name, value in taken.tree.items() if isinstance(value, TensorCopy)}
    assert set(copies) == {"a", "b", "c", "d"} and taken.tree["n"] == 4
    assert copies["a"].storage == copies["b"].storage != copies["c"].storage
    buffers = {copy.data.untyped_storage().data_ptr() for copy in copies.values()}
    assert len(buffers) == 1  # one allocation for the whole snapshot
    for name, copy in copies.items():
        assert copy.data.storage_offset() % 256 == 0 and copy.base % 256 == 0
        assert torch.equal(copy.view(), values[name]) and copy.view().stride() == values[name].stride()
    workspace.zero_()  # copies, not views of the originals
    assert torch.equal(copies["a"].view(), torch.arange(5, 17, dtype=torch.float32))
