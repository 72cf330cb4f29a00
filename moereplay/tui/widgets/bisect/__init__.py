"""Widgets of the bisect screen."""
