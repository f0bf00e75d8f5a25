"""Coalesce: control_plane."""
