"""Bundles (issue #12, part 1): `kvgraft store export` / `import` move artifacts byte for byte with their provenance,
and every hostile bundle is refused with the offending entry named and nothing written."""

from __future__ import annotations

import hashlib
import io
import json
import sqlite3
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import run_cli
from test_hostile import kvg_head, zstd_frame

from kvgraft_cli.config.manifest import with_overrides
from kvgraft_cli.config.profiles import environ_without_pins
from kvgraft_cli.errors import ArtifactError, CheckFailed, InputError, IntegrityError
from kvgraft_cli.ledger import entries
from kvgraft_cli.ledger import log as ledger
from kvgraft_cli.ledger.checkpoint import generate_key
from kvgraft_cli.runs.bundle import export_bundle, import_bundle
from kvgraft_cli.runs.context import RunContext
from kvgraft_cli.runs.gc import collect_garbage
from kvgraft_cli.store import bundle as fmt
from kvgraft_cli.util.hashing import canonical_json

GiB = 1 << 30


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def object_sums(store: Path) -> dict[str, str]:
    """SHA-256 of every object file of a store, by its path inside the store."""
    return {str(p.relative_to(store)): sha(p.read_bytes()) for p in sorted((store / "objects").rglob("*.kvg"))}


def snapshot(ctx: RunContext) -> tuple:
    """Everything an import could change: every file under the store (by hash), the index's rows, the ledger."""
    files = (
        {
            str(p.relative_to(ctx.store)): sha(p.read_bytes()) if p.is_file() else "dir"
            for p in sorted(ctx.store.rglob("*"))
        }
        if ctx.store.exists()
        else None
    )
    db = ctx.store / "index.sqlite"
    rows = list(sqlite3.connect(db).iterdump()) if db.is_file() else None
    return files, rows, ctx.ledger.read_bytes() if ctx.ledger.exists() else None


@pytest.fixture(scope="module")
def source(deposited):
    return deposited[0]


@pytest.fixture(scope="module")
def good(source, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bundle") / "all.kvgb"
    export_bundle(source, [], path)
    return path


@pytest.fixture(scope="module")
def one(source, tmp_path_factory) -> Path:
    """A bundle of one artifact, to give the receiving store something to keep unchanged."""
    path = tmp_path_factory.mktemp("bundle") / "one.kvgb"
    export_bundle(source, ["gcd-1"], path)
    return path


@pytest.fixture
def receiver(ctx, one) -> RunContext:
    """A receiving store and ledger that already hold one imported artifact."""
    import_bundle(ctx, one)
    return ctx


# -- rewriting a bundle by hand ------------------------------------------------------------------------------------


def members(path: Path) -> list[list]:
    """[TarInfo, bytes] per member, in order."""
    with tarfile.open(path) as tar:
        return [[m, tar.extractfile(m).read() if m.isreg() else b""] for m in tar.getmembers()]


def write(path: Path, items: list[list]) -> Path:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in items:
            if info.isreg():
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def listing(items: list[list]) -> dict:
    return json.loads(items[0][1])


def relist(items: list[list], value: dict) -> None:
    items[0][1] = canonical_json(value)


def find(items: list[list], name: str) -> list:
    return next(it for it in items if it[0].name == name)


def set_object(items: list[list], name: str, data: bytes, **row) -> None:
    """Replace an object member's bytes, and make its listing row agree with them (and with ``row``)."""
    find(items, name)[1] = data
    lst = listing(items)
    a = next(a for a in lst["artifacts"] if a["path"] == name)
    a.update(file_sha256=sha(data), file_bytes=len(data), **row)
    relist(items, lst)


def first_object(items: list[list]) -> str:
    return next(it[0].name for it in items if it[0].name.startswith("objects/"))


def special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


def refuses(ctx: RunContext, bundle: Path, error: type, entry: str, **kw) -> str:
    """Import must raise ``error`` naming ``entry`` and leave store and ledger exactly as they were."""
    before = snapshot(ctx)
    with pytest.raises(error) as e:
        import_bundle(ctx, bundle, **kw)
    assert type(e.value) is error, e.value.message
    assert repr(entry) in e.value.message, e.value.message
    assert snapshot(ctx) == before
    return e.value.message


# -- the round trip ------------------------------------------------------------------------------------------------


def test_round_trip_is_byte_identical_grafts_and_verifies(source, good, ctx, engine):
    report = import_bundle(ctx, good)
    sent = object_sums(source.store)
    assert object_sums(ctx.store) == sent and len(sent) == len(report.artifacts) >= 5
    assert {a["status"] for a in report.artifacts} == {"imported"}
    # One import entry, naming the bundle and every artifact with its path (so verify re-hashes each).
    (entry,) = ledger.read(ctx.ledger)
    assert entry["kind"] == "import" and entry["inputs"]["bundle"]["sha256"] == sha(good.read_bytes())
    named = {v["sha256"]: v["path"] for k, v in entry["outputs"].items() if k.startswith("artifact.")}
    assert sorted(named) == sorted(Path(p).stem for p in sent)
    r = run_cli("verify", str(ctx.ledger), "--full", "--require-files", "--json", cwd=ctx.ledger.parent, check_rc=0)
    assert json.loads(r.stdout)["files"]["ok"] == len(sent)
    # The index and library came along: a problem id resolves, and a graft of an imported artifact runs.
    from kvgraft_cli.runs.graft import graft_generate

    with ctx.open_store(create=False) as s:
        assert s.stats()["library_entries"] == len(sent) and s.stats()["unrecorded"] == 0
    got = graft_generate(ctx, engine, "gcd-1", "What is 2+2?", 4)
    with source.open_store(create=False) as s:
        assert got.artifact == s.resolve("gcd-1")
    # Importing the same bundle again changes no object and records what was already there.
    again = import_bundle(ctx, good)
    assert {a["status"] for a in again.artifacts} == {"existing"} and object_sums(ctx.store) == sent


def test_export_is_deterministic_and_a_link_brings_its_parents(source, good, tmp_path, engine):
    export_bundle(source, [], tmp_path / "again.kvgb")
    assert (tmp_path / "again.kvgb").read_bytes() == good.read_bytes()
    items = members(good)
    assert [m.name for m, _ in items][0] == fmt.LISTING and [m.name for m, _ in items][-2:] == [
        fmt.CHECKPOINT,
        fmt.LINES,
    ]
    assert all(m.mtime == 0 and m.uid == m.gid == 0 and m.mode == 0o644 and m.type == tarfile.REGTYPE for m, _ in items)
    # A chain link (built here by solve's own code, in a copy of the source) is exported with its root.
    import shutil

    from kvgraft_cli.library.chain import build_chain
    from kvgraft_cli.store.local import Store

    c = RunContext.make(source.manifest, tmp_path / "s", tmp_path / "l.jsonl")
    shutil.copytree(source.store, c.store)
    shutil.copy(source.ledger, c.ledger)
    with Store(c.store) as s:
        hits = s.library_search("What is the sum and the gcd?", c.manifest.compute_sha256, 2)
        assert len(hits) == 2
        chain = build_chain(s, engine, hits)
        link = chain.shas[-1]
    # Recorded the way solve records it (inputs.library.chain), so the link has a provenance line.
    entries.write(c.ledger, _solve_line(chain.shas, [link]))
    export_bundle(c, [link], tmp_path / "link.kvgb")
    rows = listing(members(tmp_path / "link.kvgb"))["artifacts"]
    assert {r["sha256"] for r in rows} == set(chain.shas) and len(rows) == 2
    receiving = RunContext.make(source.manifest, tmp_path / "r", tmp_path / "r.jsonl")
    import_bundle(receiving, tmp_path / "link.kvgb")
    with Store(receiving.store, create=False) as s:
        assert [sha for sha, _ in s.load_chain(link)] == chain.shas


def test_gc_after_import_keeps_imported_artifacts_and_deletes_garbage(receiver, good):
    import_bundle(receiver, good)
    kept = object_sums(receiver.store)
    # One imported artifact loses its index rows: the import line still names it, so gc keeps it.
    victim = Path(next(iter(kept))).stem
    db = sqlite3.connect(receiver.store / "index.sqlite")
    with db:
        for table in ("library", "entries"):
            db.execute(f"DELETE FROM {table} WHERE artifact = ?", (victim,))
        db.execute("DELETE FROM artifacts WHERE sha256 = ?", (victim,))
    db.close()
    garbage = receiver.store / "objects" / "ab" / f"{'ab' * 32}.kvg"
    garbage.parent.mkdir()
    garbage.write_bytes(b"x" * 10)
    report = collect_garbage(receiver.store, [receiver.ledger], grace_s=0)
    assert report.kept_for_ledger == [victim] and report.unindexed == [str(garbage)]
    assert not garbage.exists() and object_sums(receiver.store) == kept


# -- hostile bundles: refused, the entry named, nothing written ------------------------------------------------------


@pytest.mark.parametrize("relisted", [False, True], ids=["bytes-only", "listing-too"])
def test_a_tampered_artifact_is_refused(receiver, good, tmp_path, relisted):
    items = members(good)
    name = first_object(items)
    data = bytearray(find(items, name)[1])
    data[-100] ^= 1  # a bit in the last tensor
    if relisted:  # the listing made to agree: the identity check still catches it
        set_object(items, name, bytes(data))
    else:
        find(items, name)[1] = bytes(data)
    msg = refuses(receiver, write(tmp_path / "t.kvgb", items), IntegrityError, name)
    assert ("does not match its identity" if relisted else "differs from the listing") in msg


@pytest.mark.parametrize("name", ["../escape.kvg", "/tmp/absolute.kvg", "objects/../../up.kvg"])
def test_a_path_that_escapes_the_store_is_refused(receiver, good, tmp_path, name):
    items = members(good)
    items.insert(1, [tarfile.TarInfo(name), b"x"])
    assert "escapes the store" in refuses(receiver, write(tmp_path / "e.kvgb", items), ArtifactError, name)


@pytest.mark.parametrize(
    "kind,what",
    [
        (tarfile.SYMTYPE, "symbolic link"),
        (tarfile.LNKTYPE, "hard link"),
        (tarfile.CHRTYPE, "character device"),
        (tarfile.BLKTYPE, "block device"),
        (tarfile.FIFOTYPE, "fifo"),
        (tarfile.DIRTYPE, "directory"),
    ],
)
def test_links_devices_fifos_and_directories_are_refused(receiver, good, tmp_path, kind, what):
    items = members(good)
    name = first_object(items)
    find(items, name)[0] = special(name, kind, "/etc/passwd" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else "")
    assert f"is a {what}" in refuses(receiver, write(tmp_path / "s.kvgb", items), ArtifactError, name)


_PEAK = """
import atexit, sys
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
atexit.register(lambda: print("PEAK_KIB", peak(), file=sys.stderr))
sys.argv = ["kvgraft"] + sys.argv[1:]
from kvgraft_cli.cli.app import main
main()
"""


@pytest.mark.parametrize("lying", [False, True], ids=["consistent-header", "listing-lies-about-size"])
def test_a_zstd_bomb_is_refused_before_it_is_allocated(receiver, good, tmp_path, lying):
    """A 2 MB object that decompresses to 1 GiB under a borrowed identity: the lying listing is caught by the
    header alone, the consistent one by the streamed re-hash; the importing process never holds the 1 GiB."""
    head, size = kvg_head(n_tok=4, head_dim=1 << 25)
    bomb = zstd_frame(head, size - len(head), size)
    items = members(good)
    name = first_object(items)
    row = next(a for a in listing(items)["artifacts"] if a["path"] == name)
    set_object(items, name, bomb, **({} if lying else {"payload_bytes": size}))
    path = write(tmp_path / "b.kvgb", items)
    before = snapshot(receiver)
    env = environ_without_pins()
    env.pop("KVGRAFT_DEBUG", None)
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            _PEAK,
            "store",
            "import",
            str(path),
            "--store",
            str(receiver.store),
            "--ledger",
            str(receiver.ledger),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = [x for x in p.stderr.splitlines() if x.strip() and not x.startswith("PEAK_KIB")]
    peak_mib = int(p.stderr.split("PEAK_KIB")[-1]) / 1024
    assert p.returncode == 1 and len(err) == 1 and err[0].startswith("Error: ") and repr(name) in err[0], p.stderr
    assert ("declares a payload" if lying else "does not match its identity") in err[0]
    assert peak_mib < 600, f"peak RSS {peak_mib:.0f} MiB: the bomb was allocated"
    assert snapshot(receiver) == before and row["payload_bytes"] < size


def _wrong_key(items):
    lst = listing(items)
    a = lst["artifacts"][0]
    a["entries"][0]["key"] = "0" * 64  # would point another prefix at these bytes
    relist(items, lst)
    return a["path"]


def _wrong_tokens(items):
    lst = listing(items)
    lst["artifacts"][0]["num_tokens"] += 1
    relist(items, lst)
    return lst["artifacts"][0]["path"]


def _wrong_size(items):
    lst = listing(items)
    lst["artifacts"][0]["file_bytes"] += 1
    relist(items, lst)
    return lst["artifacts"][0]["path"]


def _missing(items):
    name = first_object(items)
    items.remove(find(items, name))
    return name


def _unlisted(items):
    name = f"objects/ab/{'ab' * 32}.kvg"
    items.insert(1, [tarfile.TarInfo(name), b"x"])
    return name


def _twice(items):
    name = first_object(items)
    items.insert(items.index(find(items, name)) + 1, list(find(items, name)))
    return name


def _listing_not_first(items):
    items.append(items.pop(0))
    return first_object(items)


@pytest.mark.parametrize(
    "edit,says",
    [
        (_wrong_key, "has key"),
        (_wrong_tokens, "the listing says num_tokens"),
        (_wrong_size, "the listing says"),
        (_missing, "not in the bundle"),
        (_unlisted, "not in the listing"),
        (_twice, "appears twice"),
        (_listing_not_first, "must be kvgraft-bundle.json"),
    ],
)
def test_a_listing_that_disagrees_with_the_contents_is_refused(receiver, good, tmp_path, edit, says):
    items = members(good)
    name = edit(items)
    assert says in refuses(receiver, write(tmp_path / "l.kvgb", items), ArtifactError, name)


def _bad_proof(items):
    lst = listing(items)
    proof = lst["provenance"]["lines"][0]["proof"]
    proof[0] = ("1" if proof[0][0] != "1" else "2") + proof[0][1:]
    relist(items, lst)


def _edited_line(items):
    """A provenance line changed (and every hash that covers it in the bundle updated): its proof fails."""
    lines = find(items, fmt.LINES)[1].replace(b'"kind":"deposit"', b'"kind":"deposit","note":"x"', 1)
    find(items, fmt.LINES)[1] = lines
    lst = listing(items)
    lst["provenance"]["ledger"].update(sha256=sha(lines), bytes=len(lines))
    relist(items, lst)


def _wrong_checkpoint(items):
    """The checkpoint of another ledger (another root), listed consistently."""
    import base64

    text = find(items, fmt.CHECKPOINT)[1].decode().splitlines()
    text[2] = base64.b64encode(bytes(32)).decode()
    cp = ("\n".join(text) + "\n").encode()
    find(items, fmt.CHECKPOINT)[1] = cp
    lst = listing(items)
    lst["provenance"]["checkpoint"].update(sha256=sha(cp), bytes=len(cp))
    relist(items, lst)


@pytest.mark.parametrize("edit", [_bad_proof, _edited_line, _wrong_checkpoint])
def test_a_bad_proof_or_a_wrong_checkpoint_is_refused(receiver, good, tmp_path, edit):
    items = members(good)
    edit(items)
    msg = refuses(receiver, write(tmp_path / "p.kvgb", items), IntegrityError, fmt.LINES)
    assert "not in the ledger the checkpoint commits to" in msg


def test_a_signed_checkpoint_is_checked_against_the_given_key(source, receiver, tmp_path):
    signer, verifier = generate_key("sender")
    _, stranger = generate_key("sender")
    path = tmp_path / "signed.kvgb"
    export_bundle(source, ["gcd-1"], path, key=signer)
    assert "no trusted key" in refuses(receiver, path, IntegrityError, fmt.CHECKPOINT, keys=[stranger])
    refuses(receiver, _unsigned(source, tmp_path), ArtifactError, fmt.CHECKPOINT, keys=[verifier])
    report = import_bundle(receiver, path, keys=[verifier])
    assert report.checkpoint["signed_by"] == ["sender"]


def _unsigned(source, tmp_path) -> Path:
    path = tmp_path / "unsigned.kvgb"
    export_bundle(source, ["sum-1"], path)
    return path


def test_another_compute_pin_is_refused_unless_kept_for_later(good, tmp_path):
    base = RunContext.make(with_overrides(ctx_manifest(), {"runtime.seed": 1}), tmp_path / "s", tmp_path / "l.jsonl")
    first = first_object(members(good))
    msg = refuses(base, good, InputError, first)
    assert "compute pin" in msg and not base.store.exists() and not base.ledger.exists()
    report = import_bundle(base, good, keep_foreign=True)
    assert all(a["foreign"] for a in report.artifacts) and report.artifacts
    run_cli("verify", str(base.ledger), "--full", "--require-files", cwd=tmp_path, check_rc=0)
    with base.open_store(create=False) as s:  # kept under its own pin: this manifest's runs find none of it
        assert s.library_size(base.manifest.compute_sha256) == 0 and s.library_size() == 0  # not checkable here


def ctx_manifest():
    from kvgraft_cli.config.manifest import load_manifest

    return load_manifest(None)


def test_cli_refusals_are_one_line_with_the_exit_code(receiver, good, tmp_path):
    items = members(good)
    name = first_object(items)
    find(items, name)[1] = find(items, name)[1][:-1] + b"\x01"
    tampered = write(tmp_path / "t.kvgb", items)
    items = members(good)
    items.insert(1, [tarfile.TarInfo("../x"), b"x"])
    escaping = write(tmp_path / "e.kvgb", items)
    for path, rc, entry in ((tampered, 1, name), (escaping, 2, "../x")):
        r = run_cli(
            "store",
            "import",
            str(path),
            "--store",
            str(receiver.store),
            "--ledger",
            str(receiver.ledger),
            cwd=tmp_path,
            check_rc=rc,
        )
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and repr(entry) in lines[0], r.stderr


def test_ledger_log_summarizes_an_import(receiver, tmp_path):
    r = run_cli("ledger", "log", str(receiver.ledger), "--kind", "import", "--json", cwd=tmp_path, check_rc=0)
    import json

    rows = json.loads(r.stdout)
    rows = rows["entries"] if isinstance(rows, dict) else rows
    assert [row["summary"] for row in rows] == ["bundle one.kvgb: 1 imported, 0 already stored, 0 of another pin"]


# -- review fixes: what a signed bundle's listing may not claim on the sender's word ---------------------------------


@pytest.fixture(scope="module")
def mixed(engine, tmp_path_factory) -> RunContext:
    """The examples deposited with --allow-unverified: wrong-1 (status wrong) and noref-1 (unverifiable) are stored
    and recorded, unverified, beside the verified ones."""
    from conftest import EXAMPLES

    from kvgraft_cli.runs.deposit import deposit

    d = tmp_path_factory.mktemp("mixed")
    c = RunContext.make(engine.manifest, d / "store", d / "ledger.jsonl")
    report = deposit(c, EXAMPLES, engine=engine, allow_unverified=True)
    assert {r.id for r in report.results if not r.verified} >= {"wrong-1", "noref-1"}
    return c


@pytest.fixture(scope="module")
def signer():
    return generate_key("sender")


def signed_bundle(source: RunContext, refs: list[str], path: Path, signer) -> Path:
    export_bundle(source, refs, path, key=signer[0])
    return path


def row_of(lst: dict, problem_id: str) -> dict:
    return next(a for a in lst["artifacts"] if any(e["problem_id"] == problem_id for e in a["entries"]))


def _swap_rows(lst: dict) -> str:
    """(A) sum-1's and gcd-1's library texts swapped (both answer 42, so the answers still verify): an exact hit
    for one problem would graft the other's artifact."""
    a, b = row_of(lst, "sum-1"), row_of(lst, "gcd-1")
    for k in ("problem", "solution", "answer", "problem_key"):  # same pin: each problem_key stays its text's key
        a["library"][k], b["library"][k] = b["library"][k], a["library"][k]
    return min((a, b), key=lambda r: r["sha256"])["path"]


def _respace_row(lst: dict) -> str:
    """gcd-1's problem text with a doubled space: the same problem_key (white space is normalized), still verified,
    but not the text its artifact's tokens hold."""
    a = row_of(lst, "gcd-1")
    a["library"]["problem"] = a["library"]["problem"].replace(" common ", "  common ")
    return a["path"]


def _reanswer_row(lst: dict) -> str:
    """gcd-1's library answer changed to one its solution still matches in form, but not the deposit's reference."""
    a = row_of(lst, "gcd-1")
    a["library"]["answer"] = "42.0"
    return a["path"]


def _rename_entry(lst: dict) -> str:
    """gcd-1's index row (and library row) renamed sum-1: `graft sum-1` would resolve to gcd-1's artifact."""
    a = row_of(lst, "gcd-1")
    a["entries"][0]["problem_id"] = a["library"]["problem_id"] = "sum-1"
    return a["path"]


@pytest.mark.parametrize(
    "edit,says",
    [
        (_swap_rows, "tokenize"),
        (_respace_row, "tokenize"),
        (_reanswer_row, "reference answer"),
        (_rename_entry, "record id"),
    ],
)
def test_a_signed_bundle_cannot_rebind_library_texts_or_ids(source, receiver, tmp_path, signer, edit, says):
    """Only the listing is edited: checkpoint, provenance lines and objects are the signed sender's own."""
    items = members(signed_bundle(source, ["sum-1", "gcd-1"], tmp_path / "s.kvgb", signer))
    lst = listing(items)
    name = edit(lst)
    relist(items, lst)
    msg = refuses(receiver, write(tmp_path / "e.kvgb", items), ArtifactError, name, keys=[signer[1]])
    assert says in msg


def _flip(pid: str, add_row: bool):
    def edit(lst: dict) -> str:
        from kvgraft_cli.eval.problems import normalize_key
        from kvgraft_cli.store.local import problem_key

        a = row_of(lst, pid)
        a["entries"][0]["verified"] = True
        if add_row:
            problem = "What is $9 \\cdot 8$?" if pid == "wrong-1" else "x"
            a["library"] = {
                "problem_id": pid,
                "problem_key": problem_key(a["manifest_sha256"], normalize_key(problem)),
                "problem": problem,
                "solution": "Nine eights are $\\boxed{81}$.",
                "answer": "81",
            }
        return a["path"]

    return edit


@pytest.mark.parametrize(
    "pid,add_row,status", [("wrong-1", False, "wrong"), ("wrong-1", True, "wrong"), ("noref-1", True, "unverifiable")]
)
def test_a_signed_bundle_cannot_mark_an_unverified_deposit_verified(mixed, ctx, tmp_path, signer, pid, add_row, status):
    items = members(signed_bundle(mixed, ["wrong-1", "noref-1", "sum-1"], tmp_path / "m.kvgb", signer))
    lst = listing(items)
    assert not row_of(lst, pid)["entries"][0]["verified"] and row_of(lst, pid)["library"] is None
    name = _flip(pid, add_row)(lst)
    relist(items, lst)
    msg = refuses(ctx, write(tmp_path / "f.kvgb", items), ArtifactError, name, keys=[signer[1]])
    assert f"status {status!r}" in msg
    # Unedited, the same bundle imports: the unverified deposits stay unverified and out of the library.
    report = import_bundle(ctx, tmp_path / "m.kvgb", keys=[signer[1]])
    assert {a["problem_ids"][0]: a["verified"] for a in report.artifacts} == {
        "wrong-1": False,
        "noref-1": False,
        "sum-1": True,
    }
    with ctx.open_store(create=False) as s:
        assert s.stats()["library_entries"] == 1 and s.stats()["verified_entries"] == 1


def test_an_import_line_carries_verification_to_the_next_export(source, ctx, tmp_path, signer):
    """A re-export from the receiving store is backed by its import line: verified roots keep their library rows,
    and the same edits are refused there too."""
    import_bundle(ctx, signed_bundle(source, ["sum-1", "gcd-1"], tmp_path / "s.kvgb", signer), keys=[signer[1]])
    again = tmp_path / "again.kvgb"
    export_bundle(ctx, [], again, key=signer[0])
    lst = listing(members(again))
    assert all(a["library"] and a["entries"][0]["verified"] for a in lst["artifacts"]) and len(lst["artifacts"]) == 2
    third = RunContext.make(ctx.manifest, tmp_path / "third", tmp_path / "third.jsonl")
    report = import_bundle(third, again, keys=[signer[1]])
    assert all(a["verified"] for a in report.artifacts)
    with third.open_store(create=False) as s:
        assert s.stats()["library_entries"] == 2
    items = members(again)
    lst = listing(items)
    name = _swap_rows(lst)
    relist(items, lst)
    assert "tokenize" in refuses(third, write(tmp_path / "e.kvgb", items), ArtifactError, name, keys=[signer[1]])


def test_foreign_artifacts_are_kept_without_library_rows(good, tmp_path):
    base = RunContext.make(with_overrides(ctx_manifest(), {"runtime.seed": 1}), tmp_path / "s", tmp_path / "l.jsonl")
    report = import_bundle(base, good, keep_foreign=True)
    assert report.artifacts and all(
        a["foreign"] and a["library"] == "not imported (another pin)" for a in report.artifacts
    )
    with base.open_store(create=False) as s:
        assert s.library_size() == 0


def test_two_artifacts_under_one_index_key_are_refused_naming_both(source, ctx, tmp_path):
    """Same pin and tokens, different bytes (a perturbed copy of gcd-1, recorded by a line of the sender's ledger):
    the later one must not silently win."""
    import shutil

    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.store.local import Store

    c = RunContext.make(source.manifest, tmp_path / "s", tmp_path / "l.jsonl")
    shutil.copytree(source.store, c.store)
    shutil.copy(source.ledger, c.ledger)
    with Store(c.store) as s:
        orig = s.resolve("gcd-1")
        _, art = s.load(orig, remember=False)
        layers = [
            fmt_layer
            if fmt_layer.kind == "empty"
            else type(fmt_layer)(
                fmt_layer.kind,
                fmt_layer.keys + (1e-3 if i == 0 else 0),
                fmt_layer.values,
                fmt_layer.sliding_window,
                fmt_layer.cumulative_length,
            )
            for i, fmt_layer in enumerate(art.layers)
        ]
        payload = kvg.encode(art.token_ids, layers, art.meta)
        twin = hashlib.sha256(payload).hexdigest()
        assert twin != orig
        s.put_object(twin, payload)
    entries.write(c.ledger, _solve_line([twin], []))
    path = tmp_path / "twins.kvgb"
    export_bundle(c, [orig, twin], path)
    items = members(path)
    lst = listing(items)
    a, b = (next(r for r in lst["artifacts"] if r["sha256"] == x) for x in (orig, twin))
    b["entries"] = [dict(a["entries"][0])]
    relist(items, lst)
    msg = refuses(ctx, write(tmp_path / "t.kvgb", items), CheckFailed, min(a["path"], b["path"]))
    assert repr(max(a["path"], b["path"])) in msg and "same index key" in msg


def test_a_negative_pax_size_is_named_as_such(receiver, good, tmp_path):
    items = members(good)
    name = first_object(items)
    path = tmp_path / "n.kvgb"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in items:
            if info.name == name:
                info.pax_headers = {"size": "-512"}
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    msg = refuses(receiver, path, ArtifactError, name)
    assert "negative size" in msg and "holds -512" not in msg


def test_export_says_one_ledger_line_in_the_singular(source, tmp_path):
    r = run_cli(
        "store",
        "export",
        "gcd-1",
        "-o",
        str(tmp_path / "one.kvgb"),
        "--store",
        str(source.store),
        "--ledger",
        str(source.ledger),
        cwd=tmp_path,
        check_rc=0,
    )
    assert "provenance: 1 ledger line," in r.stdout and "1 ledger lines" not in r.stdout, r.stdout


def _solve_line(chain: list[str], new_links: list[str]):
    """A solve entry that grafted ``chain`` (its inputs.library, as solve records it), the rest placeholders."""
    from kvgraft_cli.ledger.entries import Digest, SolveEntry

    d = Digest("0" * 64)
    library = {"hit": "related", "artifacts": [], "chain": chain, "scores": [], "new_links": new_links}
    return SolveEntry(
        problems_file=d,
        record=Digest.of("0" * 64, id="x", line=1),
        query_ids=d,
        library=library,
        settings={},
        query_logits=d,
        generated_ids=d,
        output=d,
        costs={},
    )
