"""Widgets of the call screen."""
