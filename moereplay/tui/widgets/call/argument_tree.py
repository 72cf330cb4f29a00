"""The argument tree: every argument of the call with dtype, shape, stride and flags; broken contracts in red."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from moereplay.format.text import printable
from moereplay.tui.arguments import ArgumentNode

KIND_STYLES = {
    "tensor": "cyan",
    "flag": "magenta",
    "scalar": "green",
    "enum": "yellow",
    "opaque": "blue",
    "none": "dim",
    "missing": "red",
    "unsupported": "red",
}


def _label(node: ArgumentNode) -> Text:
    text = Text()
    if node.violations:
        text.append("✗ ", style="bold red")
    text.append(printable(node.name), style="bold red" if node.violations else "bold")
    text.append(f" {node.kind}", style=KIND_STYLES.get(node.kind, "dim"))
    text.append(f" {printable(node.value)}")
    if node.tags:
        text.append("  " + ", ".join(node.tags), style="dim italic")
    if node.violations:
        aspects = ", ".join(dict.fromkeys(violation.aspect for violation in node.violations))
        text.append(f"  breaks its {aspects} contract", style="red")
    return text


class ArgumentTree(Tree[ArgumentNode]):
    """A tree of :class:`~moereplay.tui.arguments.ArgumentNode`; nodes with violations start expanded."""

    DEFAULT_CSS = """
    ArgumentTree { height: 1fr; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("arguments", id=id)
        self.show_root = False
        self.nodes_shown: tuple[ArgumentNode, ...] = ()

    def show(self, nodes: Sequence[ArgumentNode], note: str = "") -> None:
        """Replace the tree with ``nodes``; ``note`` is a first line (e.g. "checking contracts…")."""
        self.clear()
        self.nodes_shown = tuple(nodes)
        if note:
            self.root.add_leaf(Text(note, style="dim italic"))
        for node in nodes:
            self._add(self.root, node)
        self.root.expand()

    def _add(self, parent: TreeNode[ArgumentNode], node: ArgumentNode) -> None:
        has_children = bool(node.details or node.children or node.violations or node.description)
        if not has_children:
            parent.add_leaf(_label(node), data=node)
            return
        branch = parent.add(_label(node), data=node, expand=node.flagged)
        for violation in node.violations:
            line = Text("✗ ", style="bold red")
            line.append(
                f"{violation.aspect}: is {violation.actual}, the kernel expects {violation.expected}",
                style="red",
            )
            checked = "the host code checks it" if violation.host_checked else "not checked by the host code"
            line.append(f" ({checked}) — {violation.consequence}", style="red")
            branch.add_leaf(line)
        if node.description:
            branch.add_leaf(Text(node.description, style="italic"))
        for key, value in node.details:
            line = Text(f"{key}: ", style="dim")
            line.append(value)
            branch.add_leaf(line)
        for child in node.children:
            self._add(branch, child)

    @property
    def flagged(self) -> tuple[str, ...]:
        """Names of the arguments shown with contract violations."""
        return tuple(node.name for node in self.nodes_shown if node.violations)
