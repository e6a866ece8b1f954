"""Small primitives every layer uses: SHA-256 helpers, RFC 8785 canonical JSON, atomic writes. Imports nothing of kvgraft but errors."""
