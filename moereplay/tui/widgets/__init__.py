"""Widgets, grouped by the screen area that uses them (``browser/``, ``call/``, ``bisect/``)."""
