"""kvgraft's public Python API: the one module a program imports (``import kvgraft_cli.api as kvgraft``).

What it does, in the order a program does it (docs/API.md has the examples, and CI runs them)::

    m = kvgraft.load_manifest("manifest.yaml")        # before torch is imported: the manifest pins its flags
    kv = kvgraft.Session(m)                           # its store and ledger (the manifest's paths, or yours)
    report = kv.deposit_problems("problems.jsonl")    # verified solutions -> artifacts + ledger lines
    dep = kv.deposit_prompt("Some long shared context ...")   # any text -> an artifact in the store
    g = kv.graft(dep.artifact)                        # a transformers cache holding it, exact
    out = kv.engine.model.generate(input_ids=g.input_ids(question_ids), cache=g.cache, ...)
    check = kv.check_graft(dep.artifact)              # graft == fresh, byte for byte; a graft-check ledger line
    kvgraft.verify_ledger(kv.ledger).passed           # no torch needed: a laptop re-checks every hash
    kvgraft.read_ledger(kv.ledger, kvgraft.DepositEntry)   # the lines, typed: one class per kind

**Stable**: the names in ``__all__``, with the arguments and attributes documented here; changed only after a
release that warns. **Not stable**: everything else under ``kvgraft_cli`` (its modules are the CLI's and the
server's internals, and move when the code does), and the internals of the objects returned here beyond what is
documented (a ``Session.engine``'s own methods, say).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .audit.verify import VerifyReport
from .audit.verify import verify_ledger as _verify_ledger
from .config.manifest import Manifest, load_manifest, with_overrides
from .errors import CheckFailed, InputError, IntegrityError, KvgraftError, ModelMismatch
from .ledger import entries as _entries
from .ledger.entries import (
    DepositEntry,
    Digest,
    Entry,
    EntryError,
    GraftCheckEntry,
    ScoreEntry,
    ServeEntry,
    SolveEntry,
)
from .runs.context import RunContext

if TYPE_CHECKING:
    from .engine.engine import Engine
    from .runs.deposit import DepositReport
    from .runs.graft import CheckReport, GraftResult, Loaded
    from .runs.probe import ProbeReport
    from .store.local import Store

__all__ = [
    "CheckFailed",
    "Deposit",
    "DepositEntry",
    "Digest",
    "Entry",
    "EntryError",
    "GraftCheckEntry",
    "Grafted",
    "InputError",
    "IntegrityError",
    "KvgraftError",
    "Manifest",
    "ModelMismatch",
    "ScoreEntry",
    "ServeEntry",
    "Session",
    "SolveEntry",
    "VerifyReport",
    "load_manifest",
    "read_ledger",
    "verify_ledger",
]


def verify_ledger(
    path: str | Path,
    *,
    rehash: bool = True,
    full: bool = False,
    require_files: bool = False,
    checkpoint: str | Path | None = None,
    keys: list[str] | None = None,
    origin: str | None = None,
    since: str | Path | None = None,
    cache: str | Path | bool | None = None,
) -> VerifyReport:
    """Check a ledger as ``kvgraft verify`` does (the command calls this), without torch: every line's hash chain
    and schema, every file it names re-hashed (``rehash``; ``full`` re-reads files the verified-file cache would
    skip; ``require_files``: a missing one fails), every recorded score recomputed; ``checkpoint`` (a signed note,
    checked against ``keys`` and ``origin``), ``since`` (a base the ledger must be an append to); ``cache``: the
    verified-file cache's path, False for none, None for the user's cache folder. The report's ``passed`` is the
    verdict; ``findings`` and ``mismatched`` say what failed."""
    return _verify_ledger(
        Path(path),
        checkpoint=Path(checkpoint) if checkpoint is not None else None,
        keys=keys,
        since=Path(since) if since is not None else None,
        rehash=rehash,
        full=full,
        require_files=require_files,
        cache=Path(cache) if isinstance(cache, (str, Path)) else cache,
        origin=origin,
    )


def read_ledger(path: str | Path, *kinds: type[Entry]) -> list[Entry]:
    """A ledger's lines as typed entries, in order (no torch; no verification: that is :func:`verify_ledger`):
    each line as its kind's class (``DepositEntry``, ``GraftCheckEntry``, ``ScoreEntry``, ``SolveEntry``,
    ``ServeEntry``, ...; a kind no class models as ``Entry``, its members kept). ``kinds``: only lines of those
    classes. A line that is not what its kind records raises ``EntryError`` naming the file, line and field."""
    return _entries.read(Path(path), tuple(kinds) or None)


@dataclass(frozen=True)
class Deposit:
    """A prompt deposited in the store: the artifact's identity, its tokens and the last position's logits hash."""

    artifact: str  # the artifact's identity (what graft and check take)
    num_tokens: int
    token_ids: tuple[int, ...]
    logits_sha256: str
    path: Path  # the object file in the store
    stored: bool  # False: the store already held this prefix under this manifest (nothing was computed)


@dataclass
class Grafted:
    """A verified artifact restored into a transformers cache (``cache``), positioned after its ``token_ids``: the
    model continues it as it would continue the same prefix computed here, bit for bit."""

    artifact: str
    token_ids: list[int]
    cache: Any  # a transformers DynamicCache, plain layers: any model.generate or forward call may extend it

    def input_ids(self, continuation: list[int]) -> Any:
        """The ``input_ids`` tensor ``model.generate`` takes with this cache: the grafted tokens then
        ``continuation`` (generate reads only the tokens the cache does not hold yet)."""
        import torch

        return torch.tensor([self.token_ids + list(continuation)], dtype=torch.long)


class Session:
    """A manifest with the store and ledger its runs use (``store`` and ``ledger`` override the manifest's
    ``paths``; an ``s3://bucket/prefix`` store works as on the command line), and the engine, loaded on first use.

    Load the manifest, and make the session, before anything imports torch: the manifest's kernel flags must be in
    the environment when torch starts (a late pin is refused as drift unless ``allow_drift``)."""

    def __init__(
        self,
        manifest: Manifest | str | Path | None = None,
        *,
        store: str | Path | None = None,
        ledger: str | Path | None = None,
        allow_drift: bool = False,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(manifest, Manifest):
            manifest = load_manifest(manifest)
        if overrides:  # dotted paths, as the CLI's flags give them ({"input.problem": "question"}), re-validated
            manifest = with_overrides(manifest, overrides)
        self.run = RunContext.make(manifest, store, Path(ledger) if ledger is not None else None, allow_drift)
        self._engine: Engine | None = None
        # The manifest's pins go into the environment now, before the program imports torch
        from .engine.engine import pin_environment

        self._drift = pin_environment(manifest)

    @property
    def manifest(self) -> Manifest:
        return self.run.manifest

    @property
    def ledger(self) -> Path:
        """The ledger file every run of this session appends to."""
        return self.run.ledger

    @property
    def engine(self) -> Engine:
        """The model and tokenizer under the manifest's pins (loaded, hash-checked, once). ``engine.model`` is a
        transformers model and ``engine.tokenizer`` its tokenizer."""
        if self._engine is None:
            from .engine.engine import load_engine

            with self._loading():
                self._engine = load_engine(self.manifest, self.run.allow_drift, self._drift)
        return self._engine

    def _loading(self) -> AbstractContextManager[Any]:
        """Around the engine's load (the CLI's sessions pause garbage collection there; a program's are left as
        they are)."""
        return nullcontext()

    @contextmanager
    def store(self, create: bool = False) -> Iterator[Store]:
        """The artifact store, open for the ``with`` block (``create``: make it when it is not there yet)."""
        with self.run.open_store(create=create) as store:
            yield store

    def deposit_problems(
        self,
        path: str | Path,
        *,
        limit: int | None = None,
        allow_unverified: bool = False,
        recompute: bool = False,
        codec: str = "auto",
        ray: bool | str = False,
        workers: int | None = None,
        on_start: Callable[[int], None] | None = None,
        on_progress: Callable[[Any], None] | None = None,
    ) -> DepositReport:
        """``kvgraft deposit``: every problem of a JSON Lines file whose solution verifies becomes an artifact in
        the store, indexed for ``solve``, with a ``deposit`` ledger line (the file is checked whole first).
        ``recompute``: prefill again what the store holds, and fail unless the bytes are the same; ``codec``: how
        new files are written (``auto``, ``raw``, ``zstd``, ``shuffle-zstd``; the identity is the same); ``ray``:
        compute on Ray workers (True: a local instance; a string: the cluster's address), ``workers`` of them;
        ``on_start(n)`` and ``on_progress(result)`` report as it goes."""
        from .runs.deposit import deposit

        with self.ray_pool(ray, workers) as pool:
            return deposit(
                self.run,
                Path(path),
                limit=limit,
                allow_unverified=allow_unverified,
                recompute=recompute,
                codec=codec,
                pool=pool,
                engine=None if pool is not None else (lambda: self.engine),  # loaded once the file checks out
                on_start=on_start,
                on_progress=on_progress,
            )

    def ray_pool(self, ray: bool | str = False, workers: int | None = None) -> Any:
        """The Ray workers a run may use, as a context manager (None inside it where ``ray`` is False): True for a
        local instance, a string for a cluster's address; ``workers``: how many (default: what the CPUs hold).
        Nothing starts until a run needs it; one pool serves several runs (``solve --compare``)."""
        if ray is False or ray is None:
            if workers is not None:
                raise InputError("workers are for Ray runs", "pass ray=True (a local instance) or a cluster's address")
            return nullcontext()
        from .runs.workers.ray import RayPool

        return RayPool(self.run, ray if isinstance(ray, str) else None, workers)

    def deposit_prompt(self, text: str) -> Deposit:
        """Any text as a deposited prefix (with BOS where the manifest adds one): prefilled by the manifest's
        schedule, stored and indexed under its compute pin and tokens, so a second deposit of the same text finds
        it. A prompt has no problems file to name, so no ledger line records it: the store holds it as cache, and
        ``check_graft`` proves it. Deposit problems for a record a third party can verify."""
        from .runs.deposit import store_prefix

        engine = self.engine
        ids = engine.prefix_ids(text, where="the prompt")
        with self.run.open_store(create=True) as store:
            sha, logits_sha, stored = store_prefix(self.manifest, engine, store, ids)
            path = store.object_path(sha)
        return Deposit(sha, len(ids), tuple(ids), logits_sha, path, stored)

    def open(self, artifact: str | Path | None = None) -> Loaded:
        """Read an artifact and re-hash it, without the model (a damaged file or a wrong reference is refused before
        a model loads, not after): its identity, a unique prefix of it, a problem id or a .kvg file;
        None for the latest deposit. ``graft``, ``check_graft``, ``generate`` and ``probe`` take what this
        returns as well as a reference."""
        from .runs.graft import open_artifact

        return open_artifact(self.run, None if artifact is None else str(artifact))

    def _opened(self, artifact: str | Path | Loaded | None) -> Loaded:
        from .runs.graft import Loaded

        return artifact if isinstance(artifact, Loaded) else self.open(artifact)

    def graft(self, artifact: str | Path | Loaded) -> Grafted:
        """A fresh transformers cache holding an artifact (its identity, a prefix of it, or a .kvg file; a chain
        link with the links before it), re-hashed as it is read and refused unless it was computed under this
        manifest on kernels that give this machine's bits (ModelMismatch naming both)."""
        from .runs.graft import fit_artifact

        opened = self._opened(artifact)
        engine = self.engine
        loaded = fit_artifact(opened, self.run, engine)
        cache = engine.restore_chain(loaded.artifacts, grow=False)
        return Grafted(loaded.sha256, loaded.token_ids, cache)

    def check_graft(
        self,
        artifact: str | Path | Loaded | None = None,
        *,
        samples: int = 8,
        max_new_tokens: int = 16,
        on_sample: Callable[[Any], None] | None = None,
    ) -> CheckReport:
        """``kvgraft graft --check``: for ``samples`` questions, the grafted cache's logits and greedy tokens against
        a fresh prefill of the same prefix, compared by SHA-256; appends a ``graft-check`` ledger line. The report's
        ``passed`` is the verdict (``sha_equal`` of ``n`` samples, ``max_kl`` 0.0)."""
        from .runs.graft import graft_check

        opened = self._opened(artifact)
        return graft_check(self.run, self.engine, opened, samples, max_new_tokens, on_sample=on_sample)

    def generate(self, artifact: str | Path | Loaded | None, query: str, max_new_tokens: int) -> GraftResult:
        """``kvgraft graft``: the artifact restored, the manifest's question template around ``query`` after it,
        greedy decoding up to ``max_new_tokens`` (stops at EOS); appends a ``graft`` ledger line."""
        from .runs.graft import graft_generate

        opened = self._opened(artifact)
        return graft_generate(self.run, self.engine, opened, query, max_new_tokens)

    def probe(
        self,
        artifact: str | Path | Loaded | None,
        offsets: list[int],
        *,
        samples: int = 8,
        on_offset: Callable[[Any], None] | None = None,
    ) -> ProbeReport:
        """``kvgraft probe``: the artifact grafted at each offset (0 among them) against the prefix computed there;
        appends a ``probe`` ledger line. Exactness holds at offset 0 alone."""
        from .runs.probe import probe

        opened = self._opened(artifact)
        return probe(self.run, self.engine, opened, offsets, samples, on_offset=on_offset)
