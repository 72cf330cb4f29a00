"""Widgets of the browser screen."""
