"""Run by test_marlin_rows_interpreter.py in a child process with ``TRITON_INTERPRET=1``: the device routing
(:func:`moereplay.reference.marlin_rows.route_on_device`, one program of ``route_rows``) executed by Triton's
interpreter on the CPU, against the host's numpy routing, over aligned routings and every anomaly the host routing
has a note for. Prints one line per case and exits 1 when any differs."""

from __future__ import annotations

import sys

import numpy as np
import torch
from marlin_rows_interpreted import _index_first_element

from moereplay.reference import marlin_moe, marlin_rows
from moereplay.reference.moe_align import moe_align_block_size

K, N = 512, 256


def _host(ids, experts, total, block, slots, top_k, num_experts):  # type: ignore[no-untyped-def]
    notes: list[marlin_moe.ReferenceNote] = []
    rows = marlin_moe._route(ids, experts, total, block, slots, num_experts, notes)
    grouping = marlin_moe._group_rows(rows)
    tables = marlin_moe._row_tables(rows, top_k, slots)
    plan = marlin_rows.plan_rows(grouping.per_expert, grouping.experts, K, N)
    grouped = rows.slot.numpy()[grouping.order.numpy()]
    return notes, tables, grouped, grouping.experts, plan


def _codes(summary: dict[str, int]) -> set[str]:
    """The host notes a device summary stands for."""
    flags = {
        "negative_sorted_id": summary["negative"] > 0,
        "padding_inside_block": summary["after_padding"] > 0,
        "invalid_block_expert": summary["dropped"] > 0,
        "duplicate_slot": summary["kept"] != summary["written"],
        "padded_total_exceeds_buffers": summary["past_buffers"] > 0,
        "padded_total_not_multiple": summary["not_multiple"] > 0,
    }
    return {code for code, on in flags.items() if on}


def _compare(name, ids, experts, total, block, slots, top_k, num_experts) -> bool:  # type: ignore[no-untyped-def]
    notes, tables, grouped, used, plan = _host(ids, experts, total, block, slots, top_k, num_experts)
    routed = marlin_rows.route_on_device(ids, experts, total, block, slots, top_k, num_experts, K, N)
    assert routed is not None, name
    summary = routed.summary_of(routed.summary.tolist())
    written = len(grouped)
    same = {
        "tables": np.array_equal(routed.tables.numpy(), tables),
        "source": np.array_equal(routed.source[:written].numpy(), grouped // top_k),
        "destination": np.array_equal(routed.destination[:written].numpy(), grouped)
        and bool((routed.destination[written:] == -1).all()),
        "used": routed.used[: summary["used"]].tolist() == used
        and bool((routed.used[summary["used"] :] == -1).all()),
        "written": summary["written"] == written,
        "notes": marlin_moe._routing_needs_notes(summary) == bool(notes)
        and _codes(summary) == {n.code for n in notes},
    }
    # the row blocks: per height the host's blocks first, then spare entries with no rows
    assert plan.fields is not None and len(plan.passes) <= 1
    host_blocks, at = {}, 0
    for height, count in plan.passes[0].heights if plan.passes else ():
        host_blocks[height] = plan.fields[at : at + count]
        at += count
    fields = routed.fields.numpy()
    base = 0
    blocks_same = True
    for height, count in routed.plan.passes[0].heights:
        host = host_blocks.get(height, np.zeros((0, 4), dtype=np.int64))
        mine = fields[base : base + count]
        blocks_same &= np.array_equal(mine[: len(host)], host) and not mine[len(host) :, 1].any()
        base += count
    same["blocks"] = blocks_same
    ok = all(same.values())
    print(
        f"{name}: {'same' if ok else 'DIFFERENT ' + str(same)} ({written} rows, notes {[n.code for n in notes]})"
    )
    return ok


def main() -> int:
    _index_first_element()
    generator = torch.Generator().manual_seed(7)
    cases = []
    for tokens, top_k, experts, block in (
        (1, 4, 32, 16),
        (8, 4, 32, 16),
        (32, 4, 32, 8),
        (7, 2, 8, 64),
        (64, 1, 16, 16),
        (40, 8, 128, 16),
        (3, 6, 1000, 8),
        (200, 2, 4, 32),
    ):
        topk = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).to(
            torch.int32
        )
        ids, block_experts, total = moe_align_block_size(topk, block, experts)
        slots = tokens * top_k
        cases.append(
            (
                f"aligned m={tokens} k={top_k} e={experts} b={block}",
                ids,
                block_experts,
                total,
                block,
                slots,
                top_k,
                experts,
            )
        )
        # the same as a host int, as int64 arrays, and gemm2's top-k of 1 over the expanded rows
        cases.append(("  int total", ids, block_experts, int(total), block, slots, top_k, experts))
        cases.append(
            ("  int64", ids.long(), block_experts.long(), total.long(), block, slots, top_k, experts)
        )
        cases.append(("  gemm2", ids, block_experts, total, block, slots, 1, experts))
        # strided views of the same arrays (every other element of a twice-as-long buffer)
        wide_ids = torch.stack((ids, torch.full_like(ids, -7)), dim=1).reshape(-1)[0::2]
        wide_experts = torch.stack((block_experts, torch.full_like(block_experts, 99)), dim=1).reshape(-1)[
            0::2
        ]
        cases.append(("  strided", wide_ids, wide_experts, total, block, slots, top_k, experts))
    ids, block_experts, total = moe_align_block_size(
        torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=torch.int32), 8, 4
    )
    t = int(total)
    broken = []
    negative = ids.clone()
    negative[1] = -3
    broken.append(("negative id", negative, block_experts, total))
    duplicate = ids.clone()
    duplicate[1] = duplicate[0]
    duplicate[9] = duplicate[0]
    broken.append(("duplicate slot", duplicate, block_experts, total))
    padded = ids.clone()
    padded[0] = 99
    broken.append(("padding inside a block", padded, block_experts, total))
    bad = block_experts.clone()
    bad[1] = 7
    bad[2] = -1
    broken.append(("bad block expert", ids, bad, total))
    broken.append(("total not a multiple", ids, block_experts, torch.tensor([t - 3], dtype=torch.int32)))
    broken.append(("total past the buffers", ids, block_experts, torch.tensor([t + 64], dtype=torch.int32)))
    broken.append(("negative total", ids, block_experts, torch.tensor([-5], dtype=torch.int32)))
    broken.append(("zero total", ids, block_experts, 0))
    short = block_experts[:2].clone()
    broken.append(("short expert ids", ids, short, total))
    for name, a, b, c in broken:
        cases.append((name, a, b, c, 8, 8, 2, 4))
    # noise: entries, block experts and totals anywhere near their ranges
    for case in range(24):
        block = (8, 16, 32)[case % 3]
        experts, slots = 3 + case % 5, 4 + 3 * case
        blocks = 2 + case % 7
        low, high = (-2, slots + 3) if case % 4 == 0 else (0, slots + (case % 3))  # some: padding ids only
        noisy_ids = torch.randint(low, high, (blocks * block + case % 5,), generator=generator)
        noisy_experts = torch.randint(
            -(case % 5 == 1), experts + (case % 5 == 1), (blocks + case % 2,), generator=generator
        )
        noisy_total = (
            int(torch.randint(0, blocks + 2, (1,), generator=generator)) * block - (case % 6 == 5) * 3
        )
        cases.append(
            (
                f"noise {case}",
                noisy_ids.to(torch.int32),
                noisy_experts.to(torch.int32),
                torch.tensor([noisy_total], dtype=torch.int32),
                block,
                slots,
                1 + case % 3,
                experts,
            )
        )
    return 0 if all([_compare(*case) for case in cases]) else 1


if __name__ == "__main__":
    marlin_rows.available = lambda device, environ=None: True  # type: ignore[assignment]
    sys.exit(main())
