"""A ledger file as an RFC 6962 Merkle tree: the one place ledger lines become Merkle leaves (leaf = SHA-256(0x00 ||
line bytes), each line without its newline), and what is built from that tree: checkpoints and inclusion proofs.
`kvgraft verify`, `ledger checkpoint` and `ledger prove` all read the tree through :class:`LedgerTree`.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckFailed, InputError
from . import merkle
from .checkpoint import Checkpoint
from .log import split_lines


@dataclass
class LedgerTree:
    """A ledger's complete lines, its torn tail (bytes after the last newline) and their Merkle leaves."""

    lines: list[bytes]
    tail: bytes = b""
    leaves: list[bytes] = field(default_factory=list)

    @classmethod
    def from_bytes(cls, data: bytes) -> LedgerTree:
        lines, tail = split_lines(data)
        return cls(lines, tail, [merkle.leaf_hash(raw) for raw in lines])

    @classmethod
    def read(cls, path: Path, *, complete: bool = False) -> LedgerTree:
        """Read a ledger file; ``complete`` refuses a torn last line (a checkpoint or proof must not cover one)."""
        path = Path(path)
        if not path.is_file():
            raise InputError(f"ledger not found: {path}")
        tree = cls.from_bytes(path.read_bytes())
        if complete and tree.tail:
            raise InputError(f"{path}: torn last line", "run `kvgraft verify` and `kvgraft ledger repair` first")
        return tree

    @property
    def size(self) -> int:
        return len(self.lines)

    def root(self, size: int | None = None) -> bytes:
        """The RFC 6962 root of the first ``size`` lines (default: all)."""
        return merkle.root(self.leaves if size is None else self.leaves[:size])

    def checkpoint(self, origin: str) -> Checkpoint:
        """A checkpoint (origin, size, root) of the whole ledger."""
        return Checkpoint(origin, self.size, self.root())

    def inclusion(self, line: int, size: int | None = None) -> InclusionProof:
        """The inclusion proof of 1-based ``line`` in the tree of the first ``size`` lines (default: all),
        verified before it is returned."""
        n = size or self.size
        if n > self.size or line > n:
            raise InputError(f"line {line} of a tree of {n} lines: the ledger has {self.size} complete lines")
        tree = merkle.MerkleTree(self.leaves)
        leaf, root = self.leaves[line - 1], tree.root(n)
        proof = tree.inclusion_proof(line - 1, n)
        merkle.verify_inclusion(line - 1, n, leaf, proof, root)
        return InclusionProof(line - 1, n, leaf, root, proof)

    def consistent_with(self, size: int, root: bytes) -> bool:
        """Whether the first ``size`` lines extend a tree with ``root`` (the RFC 6962 consistency proof, generated
        from these lines and verified against ``root``: what a party holding only the old root would check)."""
        if size > self.size:
            return False
        if size == 0:
            return root == merkle.EMPTY_ROOT
        proof = merkle.MerkleTree(self.leaves).consistency_proof(size, self.size)
        try:
            merkle.verify_consistency(size, self.size, proof, root, self.root())
        except CheckFailed:
            return False
        return True


@dataclass(frozen=True)
class InclusionProof:
    """RFC 6962 inclusion proof of one leaf (0-based ``index``) in the tree of ``size`` leaves."""

    index: int
    size: int
    leaf: bytes
    root: bytes
    proof: list[bytes]

    def to_json(self) -> dict[str, Any]:
        """Hashes in base64, as in checkpoints."""
        b64 = lambda h: base64.b64encode(h).decode()  # noqa: E731
        return {
            "leafIdx": self.index,
            "treeSize": self.size,
            "leafHash": b64(self.leaf),
            "root": b64(self.root),
            "proof": [b64(h) for h in self.proof],
        }
