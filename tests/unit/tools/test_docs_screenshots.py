"""The README's screenshots: every one linked exists, every one exported is linked, and each was taken on a bundled
capture (``captures/*.moe.zst``) — not a file a test made — by ``tools/docs_screenshots.py``."""

from __future__ import annotations

import html
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "docs_screenshots.py"


def svg_text(path: Path) -> str:
    """The characters an exported SVG shows (Textual writes non-breaking spaces for spaces)."""
    pieces = re.findall(r"<text[^>]*>(.*?)</text>", path.read_text(), flags=re.S)
    return html.unescape("".join(re.sub(r"<[^>]+>", "", piece) for piece in pieces)).replace("\xa0", " ")


def test_readme_links_every_exported_screenshot_and_nothing_else() -> None:
    linked = set(re.findall(r"\((docs/[\w-]+\.svg)\)", (ROOT / "README.md").read_text()))
    exported = {f"docs/{path.name}" for path in (ROOT / "docs").glob("*.svg")}
    assert linked == exported
    shot_names = set(re.findall(r'\("shot", "([\w-]+)"\)', SCRIPT.read_text()))
    # the served capture's browser (--served FILE) is exported only from a capture brought back from a GPU run
    if not (ROOT / "docs" / "tui-served-browser.svg").exists():
        shot_names.discard("tui-served-browser")
    assert {f"docs/{name}.svg" for name in shot_names} == exported


def test_screenshots_come_from_bundled_captures() -> None:
    source = SCRIPT.read_text()
    assert "tui_captures" not in source and "CaptureWriter" not in source  # no capture made for the picture
    used = set(re.findall(r'CAPTURES / "([\w.-]+)"', source))
    assert used and all((ROOT / "captures" / name).is_file() for name in used)
    texts = {path.stem: svg_text(path) for path in (ROOT / "docs").glob("*.svg")}
    assert "marlin-nvfp4-layer.moe.zst · 3 calls" in texts["tui-browser"]
    for name in ("tui-call-variants", "tui-call-arguments", "tui-heatmap", "tui-diff", "tui-findings"):
        assert "#0 moe_wna16_marlin_gemm" in texts[name] and "backend reference" in texts[name], name
    assert "needs-kernel" in texts["tui-call-variants"]  # offline, shown as it is
    for name in ("tui-bisect", "tui-bisect-done"):
        assert "marlin-nvfp4-report.moe.zst" in texts[name], name
    assert "moereplay-captures/bisect/" in texts["tui-bisect-done"]  # the user's state dir, not a test's
    assert not any("/tmp/" in text or "pytest-" in text for text in texts.values())
