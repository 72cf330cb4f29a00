"""Text taken from a capture file, made safe to show.

Op names, call sites, header fields, error strings and argument names come from a file someone else may have
written. Shown raw, an ANSI escape sequence in one would drive the terminal (move the cursor, retitle the window,
hide text) and a ``[/]`` would be read as markup by rich or Textual (an exception, or styling the file chose). So
every front end shows file text through :func:`printable` and as *text*, never as markup (rich ``Text``,
Textual ``Content``/``Text`` objects, or ``markup=False``).
"""

from __future__ import annotations

import unicodedata

_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
"""Characters that reorder the text around them (the "Trojan Source" controls): shown escaped too."""


def printable(value: object) -> str:
    """``str(value)`` with control characters (C0, DEL, C1: ESC, newline, carriage return, …) and bidirectional
    overrides written as Python escapes (``\\x1b``, ``\\n``, ``\\u202e``), so the result is one line that a
    terminal prints literally. Other characters, non-ASCII letters included, are kept."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(_escape(character) for character in text)


def _escape(character: str) -> str:
    if character in _BIDI_CONTROLS or unicodedata.category(character) == "Cc":
        code = ord(character)
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(
            character, f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
        )
    return character
