"""What every command shares: the resolved manifest, store and ledger paths; what every ledger entry names of them
(the manifest, paths relative to the ledger) and of the engine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.manifest import Manifest
from ..ledger.entries import Digest, ManifestRef

if TYPE_CHECKING:
    from ..store.local import Store

REMOTE_SCHEME = "s3://"


@dataclass(frozen=True)
class RunContext:
    """A manifest with the store and ledger paths a command will use (CLI flags override the manifest).

    ``remote``: the ``s3://bucket/prefix`` URL of a remote store (flag or manifest ``paths.store``), else None.
    ``store`` is always a folder: for a remote store, its local cache (store.remote.cache_dir), so everything that
    writes beside the store (score records, replay outputs) still has one."""

    manifest: Manifest
    store: Path
    ledger: Path
    allow_drift: bool = False
    remote: str | None = None

    @classmethod
    def make(
        cls, manifest: Manifest, store: Path | str | None = None, ledger: Path | None = None, allow_drift: bool = False
    ) -> RunContext:
        paths = manifest.paths
        ref = str(store if store is not None else paths.store)
        if ref.startswith(REMOTE_SCHEME):
            from ..store.remote import cache_dir, normalize

            url = normalize(ref)
            return cls(manifest, cache_dir(url), Path(ledger or paths.ledger), allow_drift, url)
        return cls(manifest, Path(ref), Path(ledger or paths.ledger), allow_drift)

    @property
    def store_name(self) -> str:
        """How to name the store to a user: the remote URL, else the folder."""
        return self.remote or str(self.store)

    def open_store(self, create: bool = True, codec: str = "auto") -> Store:
        """The run's artifact store (``create=False``: refuse when there is none; readers never create one): a
        :class:`~..store.remote.RemoteStore` for a remote (named by ``remote``, or by the marker of a cache folder,
        so a context copied without ``remote`` still reaches it), else a local :class:`~..store.local.Store`."""
        remote = self.remote
        if remote is None and (self.store / "remote.json").is_file():
            from ..store.remote import remote_of

            remote = remote_of(self.store)
        if remote is not None:
            from ..store.remote import RemoteStore

            return RemoteStore(remote, create=create, codec=codec, cache=self.store)
        from ..store.local import Store

        return Store(self.store, create=create, codec=codec)

    def rel(self, path: Path) -> str:
        """A path as the ledger records it: relative to the ledger's folder when possible (so verify finds it)."""
        if self.remote is not None:
            # An object of a remote store is recorded by its URL (the cache copy is this machine's alone);
            # `kvgraft verify` reports such paths as not checked here rather than missing.
            try:
                inside = Path(path).resolve().relative_to((self.store / "objects").resolve())
                return f"{self.remote}/objects/{inside.as_posix()}"
            except ValueError:
                pass
        try:
            return os.path.relpath(Path(path).resolve(), self.ledger.resolve().parent)
        except ValueError:  # another drive on Windows
            return str(Path(path).resolve())

    def manifest_ref(self) -> ManifestRef:
        """The manifest as every ledger entry names it (its path, so verify can re-hash it; none for a built-in)."""
        m = self.manifest
        path = None if m.source.startswith("builtin:") else self.rel(Path(m.source))
        return ManifestRef(m.source, m.file_sha256, m.compute_sha256, path)


def engine_facts(engine) -> dict[str, Any]:
    """What an engine decides of a ledger entry (environment, model, drift), as keyword arguments of the entry:
    computed where the engine runs (a Ray worker's, say), recorded where the ledger is."""
    facts: dict[str, Any] = {
        "environment": engine.environment,
        "model": Digest.of(engine.hashes.model_sha256, tokenizer_sha256=engine.hashes.tokenizer_sha256),
    }
    if engine.drift:
        facts["drift"] = engine.drift.items
    return facts
