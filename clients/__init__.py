"""Coalesce: clients."""
