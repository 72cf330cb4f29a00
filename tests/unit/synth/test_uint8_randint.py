"""``uint8_randint`` draws what ``torch.randint`` draws, value for value, and leaves the generator where randint
leaves it: recipes regenerate captured weights bit for bit, so a faster draw must be the same stream."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moereplay.synth.generators import uint8_randint


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**63 - 1),
    low=st.sampled_from([0, 0, 0, 1, 3]),
    high=st.sampled_from([1, 2, 3, 16, 17, 100, 127, 128, 255, 256]),
    shape=st.lists(st.integers(0, 37), min_size=1, max_size=3),
    transposed=st.booleans(),
)
def test_same_values_and_state_as_randint(
    seed: int, low: int, high: int, shape: list[int], transposed: bool
) -> None:
    if low >= high:
        low = 0
    expected_gen = torch.Generator().manual_seed(seed)
    drawn_gen = torch.Generator().manual_seed(seed)
    expected = torch.empty(shape, dtype=torch.uint8)
    out = torch.empty(shape, dtype=torch.uint8)
    if transposed and len(shape) > 1:  # a non-contiguous output: both draw in the output's element order
        expected, out = expected.transpose(0, -1), out.transpose(0, -1)
    torch.randint(low, high, expected.shape, generator=expected_gen, out=expected)
    result = uint8_randint(drawn_gen, low, high, out)
    assert result is out
    assert torch.equal(result, expected)
    assert torch.equal(drawn_gen.get_state(), expected_gen.get_state())
    # the next draw of any kind continues the same stream
    assert torch.equal(torch.rand(5, generator=drawn_gen), torch.rand(5, generator=expected_gen))


def test_the_fact_the_fast_draw_rests_on() -> None:
    """randint(0, 16) is the full-range uint8 draw masked to its low 4 bits (one 32-bit word per element in both)."""
    gen = torch.Generator().manual_seed(3)
    codes = uint8_randint(gen, 0, 16, torch.empty(4096, dtype=torch.uint8))
    assert int(codes.max()) == 15 and int(codes.min()) == 0
    assert torch.equal(
        codes, torch.empty(4096, dtype=torch.uint8).random_(generator=torch.Generator().manual_seed(3)) & 15
    )
