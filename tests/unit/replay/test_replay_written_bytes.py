"""written_bytes_equal (the bit-exact check and the over-read detector): bytes of written rows only, NaN payloads
count, another dtype or shape is never equal (a leading batch dimension of 1 is the same shape)."""

from __future__ import annotations

import torch

from moereplay.replay.overreads import written_bytes_equal


def test_only_written_rows_count_and_every_bit_does() -> None:
    a = torch.randn(6, 5).to(torch.bfloat16)
    written = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    b = a.clone()
    assert written_bytes_equal(a, b, written)
    b[1, 2] = 7  # an unwritten row
    assert written_bytes_equal(a, b, written)
    b[2, 4] = 7
    assert not written_bytes_equal(a, b, written)
    nan = a.clone()
    nan[0, 0] = float("nan")
    payload = nan.clone()
    payload.view(torch.int16)[0, 0] += 1  # another NaN payload
    assert written_bytes_equal(nan, nan.clone(), written) and not written_bytes_equal(nan, payload, written)
    assert not written_bytes_equal(a, a.to(torch.float16), written)
    assert not written_bytes_equal(a, a[:, :4], written)
    assert written_bytes_equal(a[:0], a[:0], written[:0])


def test_a_leading_batch_dimension_of_one_holds_the_same_elements() -> None:
    """matmul_ogs returns ``[rows, N]`` while the capture records its ``[1, rows, N]`` output buffer: the bit-exact
    check and the over-read detector compare them element for element; other shapes stay unequal."""
    a = torch.randn(6, 5).to(torch.bfloat16)
    written = torch.ones(6, dtype=torch.bool)
    assert written_bytes_equal(a, a.unsqueeze(0).clone(), written)
    changed = a.unsqueeze(0).clone()
    changed[0, 3, 1] = 9
    assert not written_bytes_equal(a, changed, written)
    assert not written_bytes_equal(a, a.reshape(2, 3, 5), written)
