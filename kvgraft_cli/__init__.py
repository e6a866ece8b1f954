"""kvgraft: deposit a frozen model's KV cache as byte-exact artifacts, graft them back, and keep a ledger."""

__version__ = "0.1.0"
