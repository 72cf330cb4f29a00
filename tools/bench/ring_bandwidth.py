"""Device time of the layer flight recorder's ring launch at prefill sizes, against torch doing the same work.

At prefill a gpt-oss layer call's hidden states and output are ``tokens × 2880`` bf16 each (47 MB at vLLM's 8,192
batched tokens). The ring launch copies both into the ring and reduces the output to its largest magnitude:
≈ 5 × 47 MB of memory traffic per layer call, 24 times a step. Whether that explains the armed recorder's
prefill cost (1.04–1.06× in serve_bench) depends on how close the ring kernel comes to the copy bandwidth torch
gets. This measures, per token count, with CUDA events (median of ``--repeats``):

- ``ring``: :meth:`DeviceRing.record` of a layer call shaped as vLLM's ``triton_kernel_fused_experts`` (hidden
  states, the routing's small tensors, the output; the output checked) — one launch; ``--check`` compares the
  check reduced from the output copy's own words (``fused``, the recorder's) with a second pass over the output;
- ``torch``: the same bytes copied by ``Tensor.copy_`` into a preallocated buffer, plus ``output.abs().amax()``;
- with ``--warps`` / ``--programs`` / ``--block``, the ring kernel compiled with other ``num_warps`` or elements
  per program and loop step, and launched over another number of programs per SM (the recorder's are 4 warps —
  Triton's default —, ``ring_kernel.BLOCK`` and 4 programs per SM);
- with ``--stream 0,1``, the ring's stores plain and marked streaming (``MOEREPLAY_FLIGHT_STREAM_STORES``), each
  also followed by what vLLM runs next on the output — a residual add reading it (``+next``, beside ``next`` alone,
  both ms): the ring's own time does not show whether its writes pushed the output out of L2 for that kernel.
  Compare ``+next`` between the two settings: ``next`` alone runs with its inputs warm in L2 where they fit
  (2,048 tokens and fewer on an H100).

With ``--unkept``, rows for the output checked and fingerprinted where it is (``MOEREPLAY_FLIGHT_OUTPUT_BYTES``,
mode 4: ``unkept``) and checked only (mode 2: ``no-fp``), the inputs still copied; on an H100 (2026-12-07, 8,192
tokens) fused 0.090 ms, unkept 0.087, no-fp 0.076 — the fingerprint costs what not copying the output saves. With
``--lean``, a row for a lean call whose check passes (``MOEREPLAY_FLIGHT_LEAN_BYTES``: the output checked where it
is, then a launch that finds nothing to copy; its GB/s over the output's bytes alone).

With ``--beside``, a second table: the copy of a layer call's inputs on a side stream beside a compute-bound
stand-in for the call's kernels (a bf16 matmul of the hidden states by a 2880 × 5760 weight), as the recorder
does at prefill (``LayerFlight.before``: fork, copy, join after the call) — the matmul alone, with the copy by
the ring kernel (its programs share the SMs with the matmul's: the recorder's 4 per SM, and 16 in all, a slow copy
on a few SMs) and with the hidden states copied by the driver's device-to-device copy (``Tensor.copy_`` of their
bytes: ``cudaMemcpyAsync``, meant for a copy engine; the small tensors by the kernel), each in ms and over the
matmul alone. On an H100 (2026-12-07, 8,192 tokens): matmul 0.363 ms, + the kernel's copy 1.129×, + 16 programs'
2.020×, + the driver's 1.150× (then by ``cuMemcpyDtoDAsync`` called directly, 3d2445a) — the copy beside costs its
own time whatever does it; the driver's copy hides nothing (``MOEREPLAY_FLIGHT_BESIDE_ENGINE``, built on that, was
dropped).

Prints GB/s of each (bytes moved: copies read and written, the check's read unless fused) and the ring/torch
time ratio, all from one run. GPU only (Triton and CUDA):

    python tools/bench/ring_bandwidth.py [--tokens 8192,2048,256] [--warps 4,8] [--programs 2,4] [--block 1024,4096]
        [--check both|fused|2-pass] [--stream 0,1] [--unkept] [--lean] [--beside] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HIDDEN, TOP_K, EXPERTS = 2880, 4, 32


def layer_tensors(tokens: int, device: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The dynamic tensors of one layer call (routing's small ones included) and its output."""
    import torch

    rows = tokens * TOP_K
    small = [
        torch.zeros(n, dtype=torch.int32, device=device)
        for n in (
            EXPERTS,
            EXPERTS + 1,
            rows,
            rows,
            rows,
            rows,
            *(rows // b + EXPERTS for b in (16, 32, 64, 128)),
        )
    ]
    hidden = torch.randn(tokens, HIDDEN, device=device).to(torch.bfloat16)
    output = torch.randn(tokens, HIDDEN, device=device).to(torch.bfloat16)
    return [hidden, *small, torch.rand(rows, device=device), output], output


BATCH = 5
"""Runs of the work between two events: the host's launch time overlaps the device's previous run (at small token
counts the host still dominates — the figure is then a launch rate, not a bandwidth)."""


def timed(work, repeats: int) -> float:
    """Median milliseconds of one ``work()`` on the current stream (CUDA events around :data:`BATCH` runs, after
    two warm-up runs)."""
    import torch

    for _ in range(2):
        work()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(BATCH):
            work()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / BATCH)
    return statistics.median(samples)


def recompile(ring, warps: int, block: int, stream: bool) -> None:
    """The ring's kernel variants compiled again with ``warps`` warps per program and ``block`` elements per
    program and loop step (the launch's program count still comes from the recorder's block: the bench sets it
    per SM, above any a large copy needs)."""
    from moereplay.capture import ring_kernel

    launcher = ring.launcher
    for key in list(launcher._variants):
        aligned, code, mode = key
        constants = {
            "ALIGNED": aligned,
            "CODE": code or 3,
            "MODE": mode,
            "BLOCK": block,
            "STREAM": int(stream),
        }
        launcher._variants[key] = ring_kernel.compile_launcher(
            ring_kernel.ring_copy,
            len(ring_kernel._INTS),
            constants,
            launcher.index,
            name="ring copy",
            num_warps=warps,
        )


def then(work, following):
    """``work``, then what vLLM runs next (``following``), as one timed unit."""

    def both() -> None:
        work()
        following()

    return both


def other_row(row, label, work, moved, ring_ms, following, next_ms, options) -> None:
    """A row for another launch of the same layer call: its ms, GB/s of ``moved`` bytes, its time over the fused
    launch's (``ring_ms``, in the ring/torch column), and with what vLLM runs next."""
    ms = timed(work, options.repeats)
    print(
        f"{row[0]} {label:>6} {row[1]:>6} {ms:>8.3f} {moved / ms / 1e6:>9.0f} {'':>8} {'':>10} {ms / ring_ms:>10.2f} "
        f"{timed(then(work, following), options.repeats):>8.3f} {next_ms:>8.3f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,2048,256", help="token counts (comma-separated)")
    parser.add_argument(
        "--warps", default="4", help="num_warps of the ring kernel to try (4: the recorder's)"
    )
    parser.add_argument("--programs", default="4", help="programs per SM to try (4: the recorder's)")
    parser.add_argument(
        "--check",
        choices=("both", "fused", "2-pass"),
        default="both",
        help="the output's check reduced from its copy's words (fused: the recorder's) or by a second pass",
    )
    parser.add_argument(
        "--block", default="", help="elements per program and loop step to try (default: ring_kernel.BLOCK)"
    )
    parser.add_argument(
        "--stream",
        default="0",
        help="the ring's stores plain (0: the default) and/or streaming (1), comma-separated",
    )
    parser.add_argument(
        "--unkept",
        action="store_true",
        help="also the launch with the output checked and fingerprinted where it is, not copied "
        "(MOEREPLAY_FLIGHT_OUTPUT_BYTES): a row 'unkept' whose ring/torch column is its time over the fused (or 2-pass) row's, "
        "and 'no-fp', the same launch without the fingerprint",
    )
    parser.add_argument(
        "--lean",
        action="store_true",
        help="also the launches of a good lean call (MOEREPLAY_FLIGHT_LEAN_BYTES: the output checked where it is, "
        "then a launch that finds nothing to copy): a row 'lean' whose ring/torch column is its time over the fused (or 2-pass) row's",
    )
    parser.add_argument(
        "--beside",
        action="store_true",
        help="also the inputs' copy beside a compute-bound matmul, by the ring kernel and by the driver's copy",
    )
    parser.add_argument("--repeats", type=int, default=20)
    options = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("ring_bandwidth: needs a CUDA device", file=sys.stderr)
        return 2
    from moereplay.capture import device_ring, ring_kernel
    from moereplay.capture.device_ring import DeviceRing, over_bits

    over = over_bits(None)  # a lean call is kept for NaN or Inf: the bench's outputs are finite

    blocks = [int(text) for text in options.block.split(",")] if options.block else [ring_kernel.BLOCK]
    checks = {"both": (True, False), "fused": (True,), "2-pass": (False,)}[options.check]
    streams = [bool(int(text)) for text in options.stream.split(",")]

    device = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"ring_bandwidth: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {sms} SMs")
    print(
        f"{'tokens':>7} {'warps':>5} {'block':>5} {'prog/SM':>7} {'check':>6} {'stream':>6} {'ring ms':>8} "
        f"{'ring GB/s':>9} {'torch ms':>8} {'torch GB/s':>10} {'ring/torch':>10} {'+next ms':>8} {'next ms':>8}"
    )
    for tokens in (int(text) for text in options.tokens.split(",")):
        tensors, output = layer_tensors(tokens, device)
        copied = sum(t.numel() * t.element_size() for t in tensors)
        output_bytes = output.numel() * output.element_size()
        torch_moved = (
            2 * copied + output.numel() * output.element_size()
        )  # copies read + write, the check's read
        ring = DeviceRing(4 * copied + (1 << 20), torch.device(device))
        launcher = ring.launcher
        assert launcher is not None  # the ring kernel (ring_kernel imported above)
        target = torch.empty(copied, dtype=torch.uint8, device=device)

        def torch_work(tensors=tensors, output=output, target=target) -> None:
            at = 0
            for tensor in tensors:
                size = tensor.numel() * tensor.element_size()
                target.narrow(0, at, size).copy_(tensor.reshape(-1).view(torch.uint8))
                at += size
            output.abs().amax()

        torch_ms = timed(torch_work, options.repeats)
        residual = torch.randn_like(output)
        added = torch.empty_like(output)

        def following(output=output, residual=residual, added=added) -> None:
            torch.add(output, residual, out=added)

        next_ms = timed(following, options.repeats)
        for warps in (int(text) for text in options.warps.split(",")):
            for block, fused, stream in ((b, f, t) for b in blocks for f in checks for t in streams):
                device_ring.FUSED_CHECK = fused
                # (the variants are keyed without it: cleared after each setting, below)
                launcher.stream_stores = ring.stream_stores = stream
                ring.record(tensors, output, True)  # compiles the variant this call uses
                if options.lean:  # and the two of a lean call
                    ring.record_lean(tensors, output, over)
                if options.unkept:  # and those of the output checked only, with and without its fingerprint
                    ring.record(tensors[:-1], output, True, fingerprint=True)
                    device_ring.FINGERPRINT = False
                    ring.record(tensors[:-1], output, True, fingerprint=True)
                    device_ring.FINGERPRINT = True
                if warps != 4 or block != ring_kernel.BLOCK:
                    recompile(ring, warps, block, stream)
                # bytes moved: the copies read and written, and the check's own read unless fused
                moved = 2 * copied + (0 if fused else output.numel() * output.element_size())
                for per_sm in (int(text) for text in options.programs.split(",")):
                    launcher.programs = sms * per_sm

                    def launch(ring=ring, tensors=tensors, output=output) -> None:
                        ring.record(tensors, output, True)

                    ring_ms = timed(launch, options.repeats)
                    both_ms = timed(then(launch, following), options.repeats)
                    print(
                        f"{tokens:>7} {warps:>5} {block:>5} {per_sm:>7} {'fused' if fused else '2-pass':>6} "
                        f"{'yes' if stream else 'no':>6} {ring_ms:>8.3f} {moved / ring_ms / 1e6:>9.0f} "
                        f"{torch_ms:>8.3f} {torch_moved / torch_ms / 1e6:>10.0f} {ring_ms / torch_ms:>10.2f} "
                        f"{both_ms:>8.3f} {next_ms:>8.3f}"
                    )
                    row = f"{tokens:>7} {warps:>5} {block:>5} {per_sm:>7}", "yes" if stream else "no"
                    if options.unkept:  # the output checked where it is, not copied (FLIGHT_OUTPUT_BYTES)

                        def unkept(ring=ring, inputs=tensors[:-1], output=output) -> None:
                            ring.record(inputs, output, True, fingerprint=True)

                        moved_unkept = 2 * (copied - output_bytes) + output_bytes
                        # the recorder's launch (check and fingerprint, mode 4), then the check alone (mode 2)
                        for label, printed in (("unkept", True), ("no-fp", False)):
                            device_ring.FINGERPRINT = printed
                            other_row(row, label, unkept, moved_unkept, ring_ms, following, next_ms, options)
                        device_ring.FINGERPRINT = True
                    if options.lean:  # a lean call whose check passes: its output read, nothing copied

                        def lean(ring=ring, tensors=tensors, output=output) -> None:
                            ring.record_lean(tensors, output, over)

                        other_row(row, "lean", lean, output_bytes, ring_ms, following, next_ms, options)
                launcher._variants.clear()  # the next variants compile afresh
        device_ring.FUSED_CHECK = True
    if options.beside:
        beside_table(options, DeviceRing)
    return 0


def beside_table(options: argparse.Namespace, ring_type: type) -> None:
    """``--beside``: see the module docstring."""
    import torch

    print(
        f"\n{'tokens':>7} {'copied MB':>9} {'matmul ms':>9} {'+kernel ms':>10} {'×':>6} {'+16 prog ms':>11} "
        f"{'×':>6} {'+driver ms':>10} {'×':>6}"
    )
    side = torch.cuda.Stream()
    for tokens in (int(text) for text in options.tokens.split(",")):
        tensors, _ = layer_tensors(tokens, "cuda")
        inputs = tensors[:-1]
        copied = sum(t.numel() * t.element_size() for t in inputs)
        ring = ring_type(4 * copied + (1 << 20), torch.device("cuda"))
        weight = torch.randn(HIDDEN, 2 * HIDDEN, device="cuda").to(torch.bfloat16)
        hidden = inputs[0]

        def call(hidden=hidden, weight=weight) -> None:
            torch.matmul(hidden, weight)

        hidden_bytes = hidden.reshape(-1).view(torch.uint8)
        target = torch.empty_like(hidden_bytes)

        def beside(driver: bool, ring=ring, inputs=inputs, call=call, source=hidden_bytes, target=target):
            def work() -> None:
                fork = torch.cuda.Event()
                fork.record()
                side.wait_event(fork)
                with torch.cuda.stream(side):
                    if driver:  # the hidden states by cudaMemcpyAsync, the rest by the kernel
                        target.copy_(source)
                        ring.record(inputs[1:], None, False)
                    else:
                        ring.record(inputs, None, False)
                    joined = torch.cuda.Event()
                    joined.record(side)
                call()
                torch.cuda.current_stream().wait_event(joined)

            return work

        alone = timed(call, options.repeats)
        by_kernel = timed(beside(False), options.repeats)
        programs, ring.launcher.programs = ring.launcher.programs, 16
        by_few = timed(beside(False), options.repeats)
        ring.launcher.programs = programs
        by_driver = timed(beside(True), options.repeats)
        print(
            f"{tokens:>7} {copied / 1e6:>9.1f} {alone:>9.3f} {by_kernel:>10.3f} {by_kernel / alone:>6.3f} "
            f"{by_few:>11.3f} {by_few / alone:>6.3f} {by_driver:>10.3f} {by_driver / alone:>6.3f}"
        )


if __name__ == "__main__":
    sys.exit(main())
