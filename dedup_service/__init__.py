"""Coalesce: dedup_service."""
