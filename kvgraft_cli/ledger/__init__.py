"""The append-only JSON Lines ledger: appends under a lock, RFC 6962 Merkle trees and proofs, signed checkpoints. The only place that turns ledger lines into Merkle leaves. Torch-free."""
