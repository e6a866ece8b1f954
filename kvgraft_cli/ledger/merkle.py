"""RFC 6962 (Certificate Transparency) Merkle tree over the ledger's lines.

The tree is the one of RFC 6962 §2.1 (unchanged in RFC 9162 §2.1):

* a leaf's hash is ``SHA-256(0x00 || data)`` (:func:`leaf_hash`), where ``data`` is one ledger line;
* an inner node's hash is ``SHA-256(0x01 || left || right)`` (:func:`node_hash`);
* the tree of ``n > 1`` leaves splits at ``k``, the largest power of two strictly below ``n``: its root is
  ``node_hash(root(first k leaves), root(remaining n - k leaves))``; the tree of one leaf is that leaf's hash;
* the empty tree's root is ``SHA-256("")`` (:data:`EMPTY_ROOT`).

:func:`root` computes the Merkle Tree Hash in O(n) time and O(log n) extra memory, so a ledger of a million lines
is no problem. :class:`MerkleTree` produces inclusion proofs (audit paths, RFC 6962 §2.1.1) and consistency proofs
(RFC 6962 §2.1.2) over a list of leaf hashes. :func:`verify_inclusion` and :func:`verify_consistency` check such
proofs with the algorithms of RFC 9162 §2.1.3.2 and §2.1.4.2; they return ``None`` when the proof holds and raise
:class:`~kvgraft_cli.errors.CheckFailed` otherwise.

This module uses hashlib only (no torch, no third-party package), so that verifying a ledger stays cheap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ..errors import CheckFailed

HASH_SIZE = 32
"""Length in bytes of every hash in the tree (SHA-256)."""

EMPTY_ROOT = hashlib.sha256(b"").digest()
"""Root of the empty tree: SHA-256 of the empty string."""

_LEAF_PREFIX = b"\x00"
_NODE_PREFIX = b"\x01"


def leaf_hash(data: bytes) -> bytes:
    """Hash of a leaf holding ``data``: SHA-256(0x00 || data)."""
    return hashlib.sha256(_LEAF_PREFIX + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """Hash of an inner node whose children hash to ``left`` and ``right``: SHA-256(0x01 || left || right)."""
    return hashlib.sha256(_NODE_PREFIX + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two strictly less than ``n`` (for ``n >= 2``): where RFC 6962 splits a tree of n leaves."""
    return 1 << ((n - 1).bit_length() - 1)


def _range_root(leaf_hashes: Sequence[bytes], start: int, end: int) -> bytes:
    """Merkle Tree Hash of ``leaf_hashes[start:end]``, without copying or recursing.

    Leaves are pushed one by one onto a stack of ``(height, hash)`` pairs of perfect subtrees; two subtrees of the
    same height are merged as soon as they meet. After the last leaf the stack holds the perfect subtrees that the
    binary digits of ``end - start`` call for, largest (leftmost) first, and folding it from the right gives exactly
    RFC 6962's split at the largest power of two. The stack never holds more than ``log2(n) + 1`` entries.
    """
    if start >= end:
        return EMPTY_ROOT
    stack: list[tuple[int, bytes]] = []
    for i in range(start, end):
        height, h = 0, leaf_hashes[i]
        if len(h) != HASH_SIZE:
            raise ValueError(f"leaf hash {i} is {len(h)} bytes, not {HASH_SIZE}")
        while stack and stack[-1][0] == height:
            h = node_hash(stack.pop()[1], h)
            height += 1
        stack.append((height, h))
    h = stack.pop()[1]
    while stack:
        h = node_hash(stack.pop()[1], h)
    return h


def root(leaf_hashes: Sequence[bytes]) -> bytes:
    """Merkle Tree Hash (RFC 6962 §2.1) of the tree whose leaves hash to ``leaf_hashes``, in order.

    O(n) time and O(log n) extra memory. Raises ValueError if a leaf hash is not 32 bytes.
    """
    return _range_root(leaf_hashes, 0, len(leaf_hashes))


class MerkleTree:
    """Proof generator over a fixed list of leaf hashes (one per ledger line, see :func:`leaf_hash`).

    The list is kept by reference, not copied: do not change it while the tree is in use (appending is fine).
    Every proof is about the tree of the first ``size`` leaves, so one ``MerkleTree`` over the whole ledger answers
    for any earlier size too. Subtree roots are recomputed on demand with :func:`root`'s iterative algorithm, so a
    proof costs O(size) hashing and O(log size) memory beyond its result.

    Sizes or indices out of range are the caller's mistake and raise ValueError.
    """

    def __init__(self, leaf_hashes: Sequence[bytes]):
        for i, h in enumerate(leaf_hashes):
            if len(h) != HASH_SIZE:
                raise ValueError(f"leaf hash {i} is {len(h)} bytes, not {HASH_SIZE}")
        self._leaves = leaf_hashes

    def __len__(self) -> int:
        return len(self._leaves)

    def _check_size(self, size: int, name: str = "size") -> None:
        if not 0 <= size <= len(self._leaves):
            raise ValueError(f"{name} {size} is out of range: the tree has {len(self._leaves)} leaves")

    def root(self, size: int | None = None) -> bytes:
        """Root of the tree of the first ``size`` leaves (all of them by default)."""
        size = len(self._leaves) if size is None else size
        self._check_size(size)
        return _range_root(self._leaves, 0, size)

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        """Audit path for leaf ``index`` in the tree of the first ``size`` leaves (RFC 6962 §2.1.1, PATH(m, D[n])).

        The hashes run from the leaf's sibling up to the child of the root, as RFC 9162 §2.1.3.2 consumes them.
        """
        self._check_size(size)
        if not 0 <= index < size:
            raise ValueError(f"index {index} is out of range for a tree of size {size}")
        # Walk down from the root to the leaf; at each split the subtree that does not hold the leaf is a sibling.
        siblings: list[tuple[int, int]] = []  # (start, end) leaf ranges, root-most first
        start, end = 0, size
        while end - start > 1:
            k = _split(end - start)
            if index < start + k:
                siblings.append((start + k, end))
                end = start + k
            else:
                siblings.append((start, start + k))
                start += k
        return [_range_root(self._leaves, s, e) for s, e in reversed(siblings)]

    def consistency_proof(self, size1: int, size2: int) -> list[bytes]:
        """Proof that the tree of ``size1`` leaves is a prefix of the tree of ``size2`` leaves (RFC 6962 §2.1.2).

        RFC 6962 defines PROOF(m, D[n]) for 0 < m < n; for ``size1 == 0`` or ``size1 == size2`` there is nothing
        to prove and the proof is empty, which is what :func:`verify_consistency` expects then.
        """
        self._check_size(size2, "size2")
        if not 0 <= size1 <= size2:
            raise ValueError(f"size1 {size1} is out of range: it must be between 0 and size2 ({size2})")
        if size1 == 0 or size1 == size2:
            return []
        # SUBPROOF(m, D[start:end], whole), unrolled: each step descends into one child and records the other
        # child's range, whose root goes after the proof of the descended part.
        m, start, end, whole = size1, 0, size2, True
        tail: list[tuple[int, int]] = []  # (start, end) leaf ranges, root-most first
        while m != end - start:
            k = _split(end - start)
            if m <= k:
                tail.append((start + k, end))
                end = start + k
            else:
                tail.append((start, start + k))
                m -= k
                start += k
                whole = False
        # SUBPROOF(m, D[m], true) is empty (the verifier knows that root); SUBPROOF(m, D[m], false) is its root.
        proof = [] if whole else [_range_root(self._leaves, start, end)]
        proof.extend(_range_root(self._leaves, s, e) for s, e in reversed(tail))
        return proof


def _check_hash(name: str, value: bytes) -> None:
    if not isinstance(value, (bytes, bytearray)) or len(value) != HASH_SIZE:
        got = f"{len(value)} bytes" if isinstance(value, (bytes, bytearray)) else type(value).__name__
        raise CheckFailed(f"{name} is not a {HASH_SIZE}-byte SHA-256 hash (got {got})")


def _check_proof(proof: Sequence[bytes]) -> None:
    for i, h in enumerate(proof):
        _check_hash(f"proof hash {i}", h)


def verify_inclusion(index: int, size: int, leaf_hash: bytes, proof: Sequence[bytes], root: bytes) -> None:
    """Check that ``leaf_hash`` is leaf ``index`` of the tree of ``size`` leaves whose root is ``root``.

    The algorithm is RFC 9162 §2.1.3.2.

    Returns None if the audit path ``proof`` proves it; raises CheckFailed otherwise (index out of range, a hash
    that is not 32 bytes, a proof too long or too short for the index and size, or a root that does not match).
    """
    _check_hash("leaf hash", leaf_hash)
    _check_hash("root", root)
    _check_proof(proof)
    # 1. The leaf must be in the tree.
    if not 0 <= index < size:
        raise CheckFailed(f"inclusion proof: leaf index {index} is out of range for a tree of size {size}")
    # 2.-3. fn is the leaf's position and sn the last leaf's position at the current level; r the running hash.
    fn, sn = index, size - 1
    r = bytes(leaf_hash)
    # 4. Climb one level per proof hash.
    for p in proof:
        if sn == 0:  # 4a. already at the root, yet hashes are left
            raise CheckFailed(f"inclusion proof is too long ({len(proof)} hashes) for leaf {index} of {size}")
        if fn & 1 or fn == sn:  # 4b. p is a left sibling (or r is a right edge with no sibling at this level)
            r = node_hash(p, r)
            if not fn & 1:  # 4b-ii. skip the levels where r is a lone right-edge node
                while not fn & 1 and fn != 0:
                    fn >>= 1
                    sn >>= 1
        else:  # p is a right sibling
            r = node_hash(r, p)
        fn >>= 1  # 4c.
        sn >>= 1
    # 5. The path must reach the root exactly, and the root must match.
    if sn != 0:
        raise CheckFailed(f"inclusion proof is too short ({len(proof)} hashes) for leaf {index} of {size}")
    if r != root:
        raise CheckFailed(
            f"inclusion proof does not match the root: leaf {index} of {size} leads to {r.hex()}, "
            f"not {bytes(root).hex()}"
        )


def verify_consistency(size1: int, size2: int, proof: Sequence[bytes], root1: bytes, root2: bytes) -> None:
    """Check that the tree of ``size1`` leaves with root ``root1`` is a prefix of the tree of ``size2`` leaves with
    root ``root2`` (RFC 9162 §2.1.4.2).

    Returns None if ``proof`` proves it; raises CheckFailed otherwise. RFC 9162's algorithm covers
    ``0 < size1 < size2``; the other cases are decided as the reference implementation (transparency-dev/merkle)
    and its test vectors decide them:

    * ``size1 == 0``: fails. Every tree extends the empty tree, so such a proof proves nothing; a caller that
      compares against an empty base needs no proof (kvgraft's verify says so and skips it).
    * ``size1 > size2``: fails (a log never shrinks);
    * ``size1 == size2``: the proof must be empty and the roots equal, byte for byte.

    Otherwise both roots and every proof hash must be 32 bytes.
    """
    _check_proof(proof)
    if size1 < 0 or size2 < 0:
        raise CheckFailed(f"consistency proof: tree sizes cannot be negative (size1 {size1}, size2 {size2})")
    if size1 == 0:
        raise CheckFailed("consistency proof from the empty tree: nothing to prove (every tree extends it)")
    if size1 > size2:
        raise CheckFailed(f"consistency proof: size1 {size1} is larger than size2 {size2} (a log never shrinks)")
    if size1 == size2:
        if not isinstance(root1, (bytes, bytearray)) or not isinstance(root2, (bytes, bytearray)):
            raise CheckFailed("consistency proof: roots must be bytes")
        if proof:
            raise CheckFailed(f"consistency proof between equal sizes ({size1}) must be empty, not {len(proof)} hashes")
        if bytes(root1) != bytes(root2):
            raise CheckFailed(
                f"roots differ for the same tree size {size1}: {bytes(root1).hex()} vs {bytes(root2).hex()}"
            )
        return
    _check_hash("root1", root1)
    _check_hash("root2", root2)

    # RFC 9162 §2.1.4.2, for 0 < size1 < size2.
    # 1. An empty proof proves nothing.
    if not proof:
        raise CheckFailed(f"consistency proof from {size1} to {size2} is empty")
    # 2. If size1 is a power of two, its root is a node of the new tree and the proof leaves it out: put it back.
    path = list(proof)
    if size1 & (size1 - 1) == 0:
        path.insert(0, bytes(root1))
    # 3.-4. fn and sn: positions of the last leaf of each tree; skip the levels where the old tree's last node is a
    # right child whose whole subtree is in both trees.
    fn, sn = size1 - 1, size2 - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    # 5. fr and sr are the running roots of the old and the new tree.
    fr = sr = path[0]
    # 6. Climb one level per proof hash.
    for c in path[1:]:
        if sn == 0:  # 6a. already at the root, yet hashes are left
            raise CheckFailed(f"consistency proof from {size1} to {size2} is too long ({len(proof)} hashes)")
        if fn & 1 or fn == sn:  # 6b. c is a left sibling, in both trees
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:  # 6b-ii. skip the levels where the node is a lone right edge
                while not fn & 1 and fn != 0:
                    fn >>= 1
                    sn >>= 1
        else:  # c is a right sibling, in the new tree only
            sr = node_hash(sr, c)
        fn >>= 1  # 6c.
        sn >>= 1
    # 7. The path must reach the root exactly, and both roots must match.
    if sn != 0:
        raise CheckFailed(f"consistency proof from {size1} to {size2} is too short ({len(proof)} hashes)")
    if fr != root1:
        raise CheckFailed(
            f"consistency proof does not match root1: size {size1} leads to {fr.hex()}, not {bytes(root1).hex()}"
        )
    if sr != root2:
        raise CheckFailed(
            f"consistency proof does not match root2: size {size2} leads to {sr.hex()}, not {bytes(root2).hex()}"
        )
