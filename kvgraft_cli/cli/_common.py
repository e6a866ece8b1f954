"""What the command modules share: the common options and the few steps every engine command starts with."""

from __future__ import annotations

import gc
import inspect
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional

import typer

from ..errors import InputError


# Enums of strings for typer, so a wrong choice is a usage error that lists the allowed ones; typer reads only the
# members' values (the choices, in this order). The first five spell out config.profiles' tuples (test_cli_ux checks
# that they agree).
class Profile(StrEnum):
    portable = "portable"
    avx2 = "avx2"
    native = "native"


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


class Dtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Attn(StrEnum):
    eager = "eager"
    sdpa = "sdpa"
    grouped = "grouped"


class KvDtype(StrEnum):  # the manifest schema's model.kv_dtype
    float16 = "float16"
    bfloat16 = "bfloat16"


class Weights(StrEnum):  # config.profiles.WEIGHTS
    dequantized = "dequantized"
    q4 = "q4"


class SdpaBackend(StrEnum):
    math = "math"
    efficient = "efficient"
    flash = "flash"
    cudnn = "cudnn"


class Schedule(StrEnum):  # what `manifest init` and `matrix` offer
    single = "single"
    invariant = "invariant"


class Identity(StrEnum):  # artifacts.identity.SCHEMES, the default first
    sha256_tree = "sha256-tree"
    sha256 = "sha256"
    blake3 = "blake3"


class Codec(StrEnum):  # artifacts.container.CODECS and "auto"
    auto = "auto"
    raw = "raw"
    zstd = "zstd"
    shuffle_zstd = "shuffle-zstd"


MANIFEST_OPT = typer.Option(None, "--manifest", "-m", help="Run-manifest YAML (default: the embedded tiny Gemma-4).")
# A store is a folder or an s3:// URL: typed str, since a Path would fold "s3://b/p" into "s3:/b/p".
STORE_OPT = typer.Option(
    None,
    "--store",
    help="Store directory, or s3://BUCKET/PREFIX for a remote store (default: the manifest's paths.store).",
)
LEDGER_OPT = typer.Option(None, "--ledger", help="Ledger file (default: the manifest's paths.ledger).")
DRIFT_OPT = typer.Option(
    False, "--allow-drift", help="Proceed when the environment differs from the pin; the ledger records it."
)
# The largest count an option takes: what a ledger line's JSON holds exactly (I-JSON, 2**53 - 1); threads as the
# manifest caps them.
MAX_COUNT = 2**53 - 1
MAX_THREADS = 65536


def at_most_max_count(value: int | None) -> int | None:
    """Option callback: refuse a count past MAX_COUNT as a usage error (a range in the help would read badly)."""
    if value is not None and value > MAX_COUNT:
        raise typer.BadParameter(
            f"{value} is more than {MAX_COUNT} (2**53 - 1, the largest count a ledger line holds exactly)"
        )
    return value


JSON_OPT = typer.Option(False, "--json", help="Print a machine-readable JSON result on stdout.")
# The options every engine command takes, in this order (see engine_options).
ENGINE_OPTIONS = {
    "manifest": (Optional[Path], MANIFEST_OPT),  # noqa: UP045  (typer reads these at run time)
    "store": (Optional[str], STORE_OPT),  # noqa: UP045
    "ledger": (Optional[Path], LEDGER_OPT),  # noqa: UP045
    "allow_drift": (bool, DRIFT_OPT),
    "as_json": (bool, JSON_OPT),
}
ARTIFACT_ARG = typer.Argument(
    None,
    metavar="REF",
    help="Artifact hash or a unique prefix of it (at least 6 hex "
    "characters), problem id, or .kvg path; default: the latest deposit (never a chain link made by solve).",
)


def context(
    manifest: Path | None,
    store: str | Path | None,
    ledger: Path | None,
    allow_drift: bool,
    overrides: dict[str, Any] | None = None,
):
    """The RunContext of a command: the manifest (with command-line overrides) and the store (a folder or an
    s3:// URL) and ledger paths."""
    from ..config.manifest import load_manifest, with_overrides
    from ..runs.context import RunContext

    m = with_overrides(load_manifest(manifest), overrides or {})
    return RunContext.make(m, store, ledger, allow_drift)


def field_overrides(fields: list[str], answer_extract: str | None) -> dict[str, Any]:
    """``--field ROLE=NAME`` and ``--answer-extract`` as manifest overrides (``input.ROLE``)."""
    allowed = ("id", "problem", "solution", "answer")
    result: dict[str, Any] = {}
    for f in fields:
        role, sep, name = f.partition("=")
        if not sep or role not in allowed:
            raise InputError(
                f"--field {f!r}: expected ROLE=NAME with ROLE one of {', '.join(allowed)}",
                "e.g. --field problem=question --field solution=answer",
            )
        if not name and role in ("problem", "solution"):
            raise InputError(f"--field {f!r}: the {role} field needs a name")
        result[f"input.{role}"] = name or None
    if answer_extract:
        result["input.answer_extract"] = answer_extract
    return result


@contextmanager
def engine_start():
    """Around loading torch, transformers and a model: no cyclic garbage collection while hundreds of thousands of
    long-lived objects are created (each collection would scan them all again: docs/PERFORMANCE.md, "Start-up time"),
    then those objects are frozen out of later collections (they live as long as the process anyway)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def session(
    manifest: Any,  # a path, None (the embedded default) or a loaded Manifest (a prereg's)
    store: str | Path | None,
    ledger: Path | None,
    allow_drift: bool,
    overrides: dict[str, Any] | None = None,
):
    """The api.Session of an engine command (the manifest with the command line's overrides, its store and ledger;
    the manifest's kernel flags pinned before torch is imported), loading its engine inside engine_start."""
    from ..api import Session

    class CommandSession(Session):
        # A command's process ends with the command: what the engine's load made is frozen out of collections.
        def _loading(self):
            return engine_start()

    return CommandSession(manifest, store=store, ledger=ledger, allow_drift=allow_drift, overrides=overrides)


def artifact_and_engine(
    manifest: Path | None, store: str | Path | None, ledger: Path | None, allow_drift: bool, artifact: str | None
):
    """What graft and probe start with: (the api.Session, the opened artifact), in the safe order: the artifact read
    and re-hashed first (a bad reference fails before the slow model load), then the engine loaded."""
    s = session(manifest, store, ledger, allow_drift)
    # Reading the artifact imports torch: inside the same collection pause as the model's load (engine_start nests)
    with engine_start():
        loaded = s.open(artifact)
        s.engine  # noqa: B018  (the property loads it)
    return s, loaded


def ledger_path(ledger: Path | None, manifest: Path | None) -> Path:
    """The ledger a torch-free command reads: the argument, else the manifest's paths.ledger."""
    if ledger is not None:
        return ledger
    from ..config.manifest import load_manifest

    return Path(load_manifest(manifest).paths.ledger)


def engine_options(fn):
    """Give a command the engine options (--manifest/-m, --store, --ledger, --allow-drift, --json) once, here:
    the function declares them as plain keyword parameters and this puts typer's options in their place."""
    sig = inspect.signature(fn)
    missing = set(ENGINE_OPTIONS) - set(sig.parameters)
    if missing:
        raise TypeError(f"{fn.__name__} lacks the engine option parameters {sorted(missing)}")
    params = [p for p in sig.parameters.values() if p.name not in ENGINE_OPTIONS]
    params += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
        for name, (kind, option) in ENGINE_OPTIONS.items()
    ]
    fn.__signature__ = sig.replace(parameters=params)
    fn.__annotations__ = {**fn.__annotations__, **{name: kind for name, (kind, _) in ENGINE_OPTIONS.items()}}
    return fn


# `deposit` and `solve` on Ray workers (runs.workers.ray). typer has no option with an optional value, hence
# --ray (a local instance) and --ray-address ADDRESS (a cluster; implies --ray).
RAY_OPT = typer.Option(
    False,
    "--ray",
    help="Run the problems in shards on Ray workers, one engine each (a local Ray instance unless --ray-address); the ledger is the one a single process writes. Needs `pip install 'kvgraft[ray]'`.",
)
RAY_ADDRESS_OPT = typer.Option(
    None,
    "--ray-address",
    metavar="ADDRESS",
    help="Join this Ray cluster (auto, HOST:PORT, ray://HOST:10001); implies --ray. The store must be one every node reaches: s3://, or a path mounted at the same place on every node.",
)


def batch_option(what: str):
    """``--batch N``: at most N sequences decode in one step (1: one at a time; default engine.decoding's)."""
    from ..engine.decoding import DEFAULT_BATCH

    return typer.Option(
        DEFAULT_BATCH,
        "--batch",
        min=1,
        max=64,
        help=f"Decode up to N {what} together, one token of each a step, each with the bits it has alone "
        "(where this machine's check of the batched step passes; 1: one at a time).",
    )


WORKERS_OPT = typer.Option(
    None,
    "--workers",
    min=1,
    max=MAX_THREADS,
    help="How many Ray workers (default: as many as the cluster's CPUs hold, runtime.threads each; at least 1).",
)


def ray_choice(ray: bool, address: str | None, workers: int | None) -> bool | str:
    """--ray / --ray-address / --workers as api.Session's ``ray`` argument: False, True (a local instance) or the
    cluster's address; --workers alone is refused."""
    if not ray and address is None:
        if workers is not None:
            raise InputError("--workers is for Ray runs", "add --ray (or --ray-address ADDRESS)")
        return False
    return address if address is not None else True
