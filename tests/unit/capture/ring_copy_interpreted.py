"""The eager ring's ``ring_copy`` run by Triton's interpreter on host memory (``TRITON_INTERPRET=1``): the launch of
a layer call whose output is checked where it is, not copied (``MOEREPLAY_FLIGHT_OUTPUT_BYTES``: mode 2, no span),
against the recorder's usual launch of the same output copied and reduced from its copy's words (mode 3); and the
launch that also reduces the output's fingerprint from its words read where they are (mode 4). Per dtype and
special value, over several programs: the finished word in the slot and in the host word, its magnitude against
``largest_magnitude`` (what ``moereplay expand`` compares), the counter reset, no ring byte written by the
check-only launches, and mode 4's fingerprint — in two host words tagged with the generation, its device cell
reset — equal to ``byte_fingerprint`` (what ``expand`` recomputes from a re-run). Prints one line per case; run
by ``test_ring_kernels_triton.py``."""

from __future__ import annotations

import math

import torch

from moereplay.capture import ring_kernel
from moereplay.capture.device_ring import _CHECK_CODES, byte_fingerprint, decode_word, over_bits
from moereplay.capture.flight_layer import largest_magnitude

GENERATION = 5
UNUSED = 1 << 40
"""An address never read (a span of no bytes, mode 3's unused check pointer). The interpreter types a small integer
argument int32 — a pointer cast from it fails and ``generation << 32`` would wrap — where the compiled variants type
every integer int64: addresses and the generation are passed above 2**31 (the generation's high bits shift out of
the 64-bit word, as on the device)."""
NO_SPAN = [UNUSED, UNUSED, 0] * ring_kernel.SPANS


def launch(
    mode: int, spans: list[int], output: torch.Tensor, programs: int, *, over: int = 0, word_value: int = 0
) -> tuple[int, int, int]:
    """One launch on host memory: the slot's word, the host word and the counter after it (mode 5: the slot's
    word ``word_value`` before it, ``over`` in the check's place)."""
    word = torch.full((1,), word_value, dtype=torch.int64)
    check = output.data_ptr() if mode == 2 else (over if mode == 5 else UNUSED)
    host = torch.zeros(1, dtype=torch.int64)
    done = torch.zeros(1, dtype=torch.int32)
    generation = GENERATION + UNUSED
    args = [*spans, check, output.numel(), word.data_ptr(), generation, done.data_ptr(), host.data_ptr()]
    ring_kernel.ring_copy[(programs,)](
        *args,
        ALIGNED=1,
        CODE=_CHECK_CODES[output.dtype],
        MODE=mode,
        BLOCK=ring_kernel.BLOCK,
        STREAM=0,
    )
    return int(word[0]), int(host[0]), int(done[0])


def main() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for special in (None, math.nan, math.inf, -0.0, -65504.0):
            # an odd count: the last word holds bytes past the tensor, here not zero (they must not count)
            output = torch.full((5000,), 1234.0, dtype=dtype)[:4999].copy_(torch.linspace(-3.0, 2.0, 4999))
            if special is not None:
                output[4321] = special
            ring = torch.full((output.numel() * output.element_size() + 64,), 0xAB, dtype=torch.uint8)
            copied = [UNUSED, UNUSED, 0] * (ring_kernel.SPANS - 1) + [
                output.data_ptr(),
                ring.data_ptr(),
                (output.numel() * output.element_size() + 7) & ~7,
            ]
            fused = launch(3, copied, output, 3)
            ring.fill_(0xAB)
            unkept = launch(2, NO_SPAN, output, 3)
            untouched = bool((ring == 0xAB).all())
            cell = torch.full((1,), 12345, dtype=torch.int64)  # left over: the fingerprint adds to it
            halves = torch.zeros(2, dtype=torch.int64)
            printed = launch(
                4, [*NO_SPAN[:-3], output.data_ptr(), cell.data_ptr(), halves.data_ptr()], output, 3
            )
            untouched = untouched and bool((ring == 0xAB).all())
            # record_lean's second launch: the output's span copied only if the finished word is over the limit
            lean = launch(5, copied, output, 3, over=over_bits(None), word_value=unkept[1])
            lean_copied = not bool((ring == 0xAB).all())
            lean_right = lean_copied == (special is not None and not math.isfinite(special))
            lean_right = lean_right and (
                not lean_copied or torch.equal(ring[: output.nbytes], output.view(torch.uint8))
            )
            ring.fill_(0xAB)
            low, high = (int(h) & 0xFFFFFFFFFFFFFFFF for h in halves)
            tagged = low >> 32 == GENERATION and high >> 32 == GENERATION
            found = ((high & 0xFFFFFFFF) << 32 | (low & 0xFFFFFFFF)) - 12345 & 0xFFFFFFFFFFFFFFFF
            state, value = decode_word(unkept[1], GENERATION)
            expected = largest_magnitude(output)
            same = (math.isnan(value) and math.isnan(expected)) or value == expected
            print(
                f"{str(dtype).removeprefix('torch.')} {special}: word == host {unkept[0] == unkept[1]}, "
                f"as fused {unkept[1] == fused[1]}, counter {unkept[2]}, {state} {value} "
                f"magnitude right: {same}, ring untouched: {untouched}; fingerprinted: word as fused "
                f"{printed[1] == fused[1]}, counter {printed[2]}, cell reset {int(cell[0]) == 0}, "
                f"halves tagged {tagged}, fingerprint right {found == byte_fingerprint(output)}; lean: "
                f"{'copied' if lean_copied else 'not copied'} right {lean_right}, word kept {lean[0] == unkept[1]}, "
                f"published {lean[1] == unkept[1]}, counter {lean[2]}"
            )


if __name__ == "__main__":
    main()
