"""`kvgraft inspect`: an artifact's header (layers, tokens, chain link, dtype, pins, sizes) without decoding it."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from ..errors import IntegrityError
from ._common import JSON_OPT, MANIFEST_OPT, STORE_OPT, context
from ._output import cell, human_bytes, out, print_json, printable, table


def inspect(
    ref: str = typer.Argument(
        ...,
        metavar="REF",
        help="A .kvg file, or an artifact in the store: its hash, a unique "
        "prefix of it (at least 6 hex characters) or a problem id.",
    ),
    store: str | None = STORE_OPT,
    manifest: Path | None = MANIFEST_OPT,
    rehash: bool = typer.Option(
        False,
        "--hash",
        help="Also re-hash the whole payload (streamed) and check it "
        "against the artifact's identity; exit 1 if it differs.",
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Show an artifact's header without decoding its tensors: layers and their kinds (full, sliding with its
    window, empty), tokens, start position and parent (chain links), dtype, model and compute pins, file and payload
    sizes. Torch-free. Exit 2 for a file that is not an artifact, 1 for a damaged one."""
    from ..artifacts.inspect import payload_sha256, read_info
    from ..artifacts.verdict import judged

    path, named = _locate(ref, store, manifest)
    # With --hash, a refusal is judged against the identity (artifacts.verdict): a damaged artifact exits 1
    # whether it was named by hash or by path, as graft and verify say.
    info = read_info(path, named if rehash else None)
    info.sha256 = named  # what the file name (a store's or a copy's) claims, until --hash checks it
    if rehash:
        with judged(path, named):
            got = payload_sha256(path)
        if named and got != named:
            raise IntegrityError(
                f"{path}: content hash {got} does not match its identity {named} (tampered or corrupt)",
                "delete it and re-deposit, or re-import it from a good copy",
            )
        info.sha256 = got
    if as_json:
        print_json({**info.to_json(), "identity_checked": rehash})
        return
    _render(info, rehash, named)


def _locate(ref: str, store: str | None, manifest: Path | None) -> tuple[Path, str | None]:
    """(the .kvg file, the identity its name or the store gives it, if any)."""
    p = Path(ref)
    if ref.endswith(".kvg") or p.is_file() or "/" in ref or "\\" in ref:
        stem = p.name[: -len(".kvg")] if p.name.endswith(".kvg") else p.name
        return p, stem if re.fullmatch(r"[0-9a-f]{64}", stem) else None

    ctx = context(manifest, store, None, False)
    with ctx.open_store(create=False) as s:
        sha = s.resolve(ref, ctx.manifest.machine_compute_sha256)
        # A remote store (store.remote.RemoteStore) fetches its object into its cache first, re-hashed on arrival.
        return getattr(s, "local_object", s.object_path)(sha), sha


def _render(info, rehash: bool, named: str | None) -> None:
    def line(label: str, value: str) -> None:
        out.print(f"{label:<10} {printable(value, newlines=False)}", markup=False, soft_wrap=True)

    line("artifact", info.path)
    if rehash:
        line(
            "identity", f"{info.sha256} (payload re-hashed: matches)" if named else f"{info.sha256} (payload re-hashed)"
        )
    elif named:
        line("identity", f"{named} (its file name; not re-hashed: --hash checks it)")
    else:
        line("identity", "not checked (--hash re-hashes the payload)")
    if info.parent_sha256:
        line("link", f"chain link: continues {info.parent_sha256}, starts at position {info.start_position}")
    else:
        line("link", f"root (starts at position {info.start_position})")
    end = info.start_position + info.num_tokens - 1
    line("tokens", f"{info.num_tokens} (positions {info.start_position}..{end})" if info.num_tokens else "0")
    prefill = info.prefill.get("schedule") if isinstance(info.prefill, dict) else info.prefill
    kv = f", KV cache {info.kv_dtype}" if info.kv_dtype else ""
    line("dtype", f"{info.dtype}{kv} (computed on {info.device or '?'}, prefill {prefill})")
    line("model", f"{info.model_sha256}")
    line("tokenizer", f"{info.tokenizer_sha256}")
    line("compute", f"{info.compute_sha256} (the manifest's compute pin)")
    line("logits", f"{info.logits_sha256} ({info.logits_dtype}, last prefix position)")
    ratio = f"{info.compression_ratio:.2f}x" if info.compression_ratio else "n/a"
    line(
        "sizes",
        f"file {human_bytes(info.file_bytes)} ({info.file_bytes:,} B), payload "
        f"{human_bytes(info.payload_bytes)} ({info.payload_bytes:,} B; header {info.header_bytes:,} B), "
        f"compression {ratio} (codec {info.codec})",
    )
    counts = {k: sum(l.kind == k for l in info.layers) for k in ("full", "sliding", "empty")}
    windows = sorted({str(l.window) for l in info.layers if l.kind == "sliding" and l.window is not None})
    win = f" (window {', '.join(windows)})" if windows else ""
    line(
        "layers", f"{info.num_layers}: {counts['full']} full, {counts['sliding']} sliding{win}, {counts['empty']} empty"
    )
    for k, v in info.other_metadata.items():
        line(k, v)
    t = table(
        None,
        ("layer", "kind", "window", "seen", "kv heads", "kept", "head dim", "bytes"),
        right=("layer", "window", "seen", "kv heads", "kept", "head dim", "bytes"),
    )
    for l in info.layers:
        t.add_row(
            str(l.index),
            cell(l.kind),
            _n(l.window),
            _n(l.seen),
            _n(l.kv_heads),
            _n(l.kept),
            _n(l.head_dim),
            human_bytes(l.tensor_bytes) if l.tensor_bytes else "",
        )
    out.print(t)


def _n(v):
    return cell("" if v is None else v)
