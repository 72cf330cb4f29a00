"""File text inside Textual markup: escaped, so ``[/]`` in an op name or message is shown, not interpreted, and
control characters are shown as escapes (:func:`moereplay.format.text.printable`)."""

from __future__ import annotations

from textual.markup import escape

from moereplay.format.text import printable


def as_text(value: object) -> str:
    """``value`` ready to interpolate into a Textual markup string: printable, with markup escaped."""
    return escape(printable(value))
