"""Coalesce: worker."""
