"""Coalesce: security. Who may call (bearer tokens mapped to tenants, the workers' internal token) and how
the wire is protected (TLS and mTLS credentials). Used by every server and client; imports nothing of ours.
See docs/security.md."""
