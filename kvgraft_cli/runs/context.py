"""What every command shares: the resolved manifest, store and ledger paths, and the ledger entry's common part."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..util.hashing import digest
from ..config.manifest import Manifest

if TYPE_CHECKING:
    from ..store.local import Store


@dataclass(frozen=True)
class RunContext:
    """A manifest with the store and ledger paths a command will use (CLI flags override the manifest)."""

    manifest: Manifest
    store: Path
    ledger: Path
    allow_drift: bool = False

    @classmethod
    def make(cls, manifest: Manifest, store: Path | None = None, ledger: Path | None = None,
             allow_drift: bool = False) -> "RunContext":
        paths = manifest.data["paths"]
        return cls(manifest, Path(store or paths["store"]), Path(ledger or paths["ledger"]), allow_drift)

    def open_store(self, create: bool = True, codec: str = "auto") -> "Store":
        """The run's artifact store (``create=False``: refuse when there is none; readers never create one)."""
        from ..store.local import Store

        return Store(self.store, create=create, codec=codec)

    def rel(self, path: Path) -> str:
        """A path as the ledger records it: relative to the ledger's folder when possible (so verify finds it)."""
        try:
            return os.path.relpath(Path(path).resolve(), self.ledger.resolve().parent)
        except ValueError:  # another drive on Windows
            return str(Path(path).resolve())

    def entry_base(self, engine=None) -> dict[str, Any]:
        """The part of a ledger entry every engine command writes: manifest, environment, drift."""
        m = self.manifest
        base: dict[str, Any] = {
            "manifest": {
                "source": m.source,
                **digest(m.file_sha256),
                "compute_sha256": m.compute_sha256,
            },
        }
        if not m.source.startswith("builtin:"):
            base["manifest"]["path"] = self.rel(Path(m.source))  # so verify can re-hash it
        if engine is not None:
            base["environment"] = engine.environment
            base["model"] = {**digest(engine.hashes.model_sha256), "tokenizer_sha256": engine.hashes.tokenizer_sha256}
            if engine.drift:
                base["drift"] = engine.drift.items
        return base
