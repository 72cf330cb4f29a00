"""Text from the capture file (op, site, layer, argument names, messages) is shown literally: never parsed as
Textual markup (``[/]`` raised MarkupError and closed the app), never sent to the terminal as control sequences."""

from __future__ import annotations

from pathlib import Path

import torch
from tui_helpers import make_app, run_async, settle

from moereplay.format import CaptureWriter
from moereplay.format.text import printable
from moereplay.tui.screens.browser import BrowserScreen
from moereplay.tui.screens.call import CallScreen
from moereplay.tui.widgets.browser.call_table import CallTable
from moereplay.tui.widgets.call.argument_tree import ArgumentTree

HOSTILE = "[/]x[bold]y\x1b[31mz[$error]"
SHOWN = printable(HOSTILE)  # the literal text, its escape character written as \x1b


def _hostile_capture(path: Path) -> Path:
    with CaptureWriter(path) as writer:
        index = writer.begin_call(
            "op" + HOSTILE,
            {"input": torch.ones(2, 3), "name" + HOSTILE: torch.zeros(2), "flag": HOSTILE},
            site="site" + HOSTILE,
            context={"layer": "layer" + HOSTILE, "step": 1, "layer_name": "model." + HOSTILE},
        )
        writer.complete_call(index, {"output": torch.ones(2, 3)}, status="failed", error="error" + HOSTILE)
    return path


def _plain(widget: object) -> str:
    return str(widget.render())  # type: ignore[attr-defined]


@run_async
async def test_hostile_strings_in_the_file_are_shown_as_text(workdir: Path) -> None:
    app = make_app(_hostile_capture(Path("hostile.moe.zst")))
    async with app.run_test(size=(160, 30)) as pilot:
        await settle(pilot)
        screen = app.screen
        assert isinstance(screen, BrowserScreen)  # mounted: no MarkupError
        row = "".join(segment.text for segment in screen.query_one(CallTable).render_line(1))
        assert "\x1b" not in row and ("op" + SHOWN)[:20] in row
        detail = _plain(screen.query_one("#call-detail"))
        assert "\x1b" not in detail and f"site site{SHOWN}" in detail
        await pilot.press("enter")
        await settle(pilot)
        call = app.screen
        assert isinstance(call, CallScreen)
        title = _plain(call.query_one("#call-title"))
        assert f"#0 op{SHOWN}" in title and f"layer layer{SHOWN}" in title and "\x1b" not in title
        tree = call.query_one(ArgumentTree)
        labels = [str(line.label) for line in _tree_nodes(tree.root)]
        assert any(f"name{SHOWN}" in label for label in labels), labels
        assert any(SHOWN in label and label.startswith("flag") for label in labels), labels
        assert not any("\x1b" in label for label in labels)


def _tree_nodes(node):  # type: ignore[no-untyped-def]
    for child in node.children:
        yield child
        yield from _tree_nodes(child)


@run_async
async def test_findings_quoting_the_file_are_shown_as_text(workdir: Path) -> None:
    from moereplay.replay.findings import Finding, FindingKind
    from moereplay.tui.widgets.call.findings_panel import FindingsPanel, finding_text

    finding = Finding(
        FindingKind.CONTRACT_VIOLATION,
        f"argument name{HOSTILE} breaks\nits contract",
        variant="flip " + HOSTILE,
    )
    plain = finding_text(finding).plain
    assert f"argument name{SHOWN} breaks\\nits contract" in plain and f"flip {SHOWN}" in plain
    assert "\x1b" not in plain
    app = make_app(_hostile_capture(Path("hostile.moe.zst")))
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(pilot)
        await pilot.press("enter")
        await settle(pilot)
        panel = app.screen.query_one(FindingsPanel)
        panel.add_option(finding_text(finding))  # a finding's message drawn in the panel: no MarkupError
        await pilot.pause()
        assert SHOWN in str(panel.get_option_at_index(panel.option_count - 1).prompt)
