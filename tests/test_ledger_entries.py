"""Ledger entries are typed (kvgraft_cli/ledger/entries.py): every line kvgraft writes reads back into its kind's
class and writes out as the same bytes; the classes agree with the schema; and no code outside the entry types
builds or takes apart a ledger entry by key (a grep a reader can repeat)."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import pytest
from source_grep import TOPS, grep_sources

from kvgraft_cli.errors import LedgerError
from kvgraft_cli.ledger import entries
from kvgraft_cli.ledger.entries import (
    KINDS,
    Digest,
    EntryError,
    ManifestRef,
    OtherEntry,
    ScoreEntry,
    ServeEntry,
)
from kvgraft_cli.util.hashing import canonical_json

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "ledger" / "reference.jsonl"


def test_the_reference_ledger_reads_back_byte_for_byte():
    lines = REFERENCE.read_bytes().splitlines()
    typed = entries.read(REFERENCE)
    assert len(typed) == len(lines) == 36
    assert not any(isinstance(e, OtherEntry) for e in typed)
    assert [canonical_json(e.to_json()) for e in typed] == lines
    assert {e.kind for e in typed} == {"register", "deposit", "graft-check", "score", "replay"}


def _sample(cls):
    """An entry of ``cls`` with every field set (digests, lists, dicts of their kind's shape)."""
    h = "ab" * 32
    values = {}
    for f in fields(cls):
        if "at" not in f.metadata:
            continue
        typ = f.metadata["as"]
        first = typ[0] if isinstance(typ, tuple) else typ
        values[f.name] = {
            Digest: Digest.of(h, "x/y.jsonl", count=3, ids=[1, 2]),
            ManifestRef: ManifestRef("manifests/a.yaml", h, h, "../manifests/a.yaml"),
            int: 7,
            str: "s",
            bool: True,
            dict: {"k": [1, "2"], "n": 2, "correct": 1, "passed": True, "exact_offsets": [0], "none": None},
            list: ["a", 1],
        }.get(first)
        if f.name == "verification":
            values[f.name] = entries.Verification.of("verified", "ok", "1", "1")
    return cls(**values)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_reads_back_as_written(kind, tmp_path):
    cls = KINDS[kind]
    e = _sample(cls)
    if kind == "import":
        e = e.__class__(
            **{**{f.name: getattr(e, f.name) for f in fields(e)}, "artifacts": {"cd" * 32: Digest("cd" * 32)}}
        )
    body = e.to_json()
    assert cls.from_json(body) == e and cls.from_json(body).to_json() == body
    written = entries.write(tmp_path / "l.jsonl", e)
    raw = (tmp_path / "l.jsonl").read_bytes().rstrip(b"\n")
    assert (written.seq, written.kind) == (0, kind) and canonical_json(written.to_json()) == raw
    assert entries.parse(json.loads(raw)) == written
    assert written.summary()  # `ledger log`'s "what"
    assert written.shown_digests() or kind == "replay-served"  # and the hashes it shows
    if kind == "import":
        assert json.loads(raw)["outputs"]["artifact." + "cd" * 32] == {"sha256": "cd" * 32}


def test_members_no_class_models_are_kept():
    """A newer kvgraft's line (a member this one does not know, at any level) reads and writes back unchanged."""
    line = json.loads(REFERENCE.read_bytes().splitlines()[1])  # a deposit
    line["inputs"]["novel"] = {"sha256": "0" * 64}
    line["outputs"]["later"] = 5
    line["future"] = ["x"]
    e = entries.parse(line)
    assert e.extra == {"inputs": {"novel": {"sha256": "0" * 64}}, "outputs": {"later": 5}, "": {"future": ["x"]}}
    assert e.to_json() == line


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["outputs"].pop("artifact"), "a deposit entry without outputs.artifact"),
        (lambda d: d["inputs"].update(record=[1]), "inputs.record is not a digest"),
        (lambda d: d.update(verification={"status": 1}), "verification is not an object with a status string"),
        (lambda d: d.update(inputs=[1]), "inputs is not an object"),
        (lambda d: d["manifest"].update(path=5), "manifest.path is not a string"),
        (lambda d: d["outputs"]["logits"].update(path=["x"]), "outputs.logits.path is not a string"),
    ],
)
def test_a_line_that_is_not_what_its_kind_records_is_named(edit, message):
    line = json.loads(REFERENCE.read_bytes().splitlines()[1])
    edit(line)
    with pytest.raises(EntryError, match=re.escape(message)) as e:
        entries.parse(line, "ledger.jsonl:2")
    assert isinstance(e.value, LedgerError) and e.value.message.startswith("ledger.jsonl:2: ")


def test_an_entry_that_would_not_read_back_is_refused_before_writing(tmp_path):
    """Can fail: a digest whose facts shadow its path, or a member that lands on a field of another type."""
    bad = _sample(ScoreEntry)
    bad = ScoreEntry(
        **{**{f.name: getattr(bad, f.name) for f in fields(bad)}, "records": Digest("0" * 64, None, {"path": 5})}
    )
    with pytest.raises(EntryError, match="would not read back"):
        entries.write(tmp_path / "l.jsonl", bad)
    assert not (tmp_path / "l.jsonl").exists() or (tmp_path / "l.jsonl").read_bytes() == b""


def test_the_classes_require_what_the_schema_requires():
    """The schema's per-kind requirements (schemas/ledger-entry.schema.json) are required fields of the classes."""
    schema = json.loads((ROOT / "kvgraft_cli" / "schemas" / "ledger-entry.schema.json").read_text())
    for rule in schema["allOf"]:
        kind = rule["if"]["properties"]["kind"]
        for k in kind.get("enum", [kind.get("const")]):
            cls = KINDS[k]
            required = {f.name for f in fields(cls) if "at" in f.metadata and not f.metadata["optional"]}
            for place in ("inputs", "outputs"):
                want = set(rule["then"]["properties"].get(place, {}).get("required", []))
                have = {f.name for f in fields(cls) if f.metadata.get("at") == place and f.name in required}
                assert want <= have, (k, place, want - have)


def test_serve_lines_keep_an_absent_first_logits_absent():
    e = _sample(ServeEntry)
    e2 = ServeEntry(**{**{f.name: getattr(e, f.name) for f in fields(e)}, "first_logits": None})
    assert "first_logits" not in e2.to_json()["outputs"] and ServeEntry.from_json(e2.to_json()) == e2


# -- no ledger entry built or read by key outside the entry types ---------------------------------------------------

# An entry's sections named as strings or keywords, read by .get, subscripted off a call (json.loads(...)["outputs"])
# or off the names lines go by; and raw appends (ledger.log.append) outside the ledger package.
LEDGER_LITERAL = re.compile(
    r"""["']inputs["']"""
    r"""|\b(?:inputs|outputs|verification)=\{"""
    r"""|\.get\(["'](?:outputs|verification|status)["']"""
    r"""|\.get\(["']kind["']\)\s*[!=]=\s*["']"""
    r"""|\)\[["'](?:outputs|verification)["']\]"""
    r"""|\b(?:e|entry|line|raw|se|written)\[["'](?:outputs|verification|status|kind|seq|manifest)["']\]"""
    r"""|\b(?:ledger|log|ledger_mod|ledger_log)\.append\("""
    r"""|\.entry_base\("""
)


def ledger_literals(root: Path) -> list[str]:
    """``path:line: text`` of every ledger entry built or read by key outside kvgraft_cli/ledger/, under ``root``'s
    kvgraft_cli/, scripts/ and benchmarks/."""
    return grep_sources(root, LEDGER_LITERAL, "ledger")


def test_no_ledger_entry_is_built_or_read_by_key_outside_the_types():
    assert ledger_literals(ROOT) == []


def test_the_grep_sees_an_entry_built_or_read_by_key(tmp_path):
    """Can fail: each way the writers and readers used to build or take apart an entry is named, file and line."""
    for top in TOPS:
        (tmp_path / top).mkdir()
    (tmp_path / "kvgraft_cli" / "ledger").mkdir()
    (tmp_path / "kvgraft_cli" / "ledger" / "ok.py").write_text('x = {"inputs": 1}\n')  # the types' own home
    (tmp_path / "kvgraft_cli" / "a.py").write_text(
        "entry = ctx.entry_base(engine)\n"
        'entry.update(inputs={"artifact": d})\n'
        'ok = check(path, reads={"the file": p})\n'
        'n = e["inputs"]["record"]["id"]\n'
        "ledger.append(ctx.ledger, kinds.SCORE, entry)\n"
    )
    (tmp_path / "benchmarks" / "b.py").write_text(
        'v = (e.get("outputs") or {}).get("costs")\nt = json.loads(lines[3])["outputs"]["costs"]\nrow = {"outputs": 1}\n'
        'st = [x.get("status") for x in lines if x.get("kind") == "deposit"]\n'
    )
    assert ledger_literals(tmp_path) == [
        "kvgraft_cli/a.py:1: entry = ctx.entry_base(engine)",
        'kvgraft_cli/a.py:2: entry.update(inputs={"artifact": d})',
        'kvgraft_cli/a.py:4: n = e["inputs"]["record"]["id"]',
        "kvgraft_cli/a.py:5: ledger.append(ctx.ledger, kinds.SCORE, entry)",
        'benchmarks/b.py:1: v = (e.get("outputs") or {}).get("costs")',
        'benchmarks/b.py:2: t = json.loads(lines[3])["outputs"]["costs"]',
        'benchmarks/b.py:4: st = [x.get("status") for x in lines if x.get("kind") == "deposit"]',
    ]


def _line(n: int) -> dict:
    return json.loads(REFERENCE.read_bytes().splitlines()[n])


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["manifest"].update(origin="x"),  # a member a newer kvgraft writes, in the manifest...
        lambda d: d["verification"].update(grader="g"),  # ... in the verification
        lambda d: d["outputs"]["artifact"].update(path=None),  # a null path
        lambda d: d.pop("seq"),  # no seq: prev, kind and time kept as they are
        lambda d: d.update(seq="1"),  # a seq that is no integer
        lambda d: d.update(prev=5),
    ],
)
def test_odd_lines_read_back_as_they_are(edit):
    """Lines no kvgraft writes but the schema allows (or a reader must survive) read back to their own JSON."""
    from kvgraft_cli.runs.bundle import backing, recorded_by

    line = _line(1)  # a deposit
    edit(line)
    e = entries.parse(line)
    assert e.to_json() == line
    assert e.lineno in (0, 2) and (e.seq is None) == (e.lineno == 0)
    if "seq" in line and type(line["seq"]) is int and isinstance(line.get("prev"), (str, type(None))):
        assert recorded_by(line) == {line["outputs"]["artifact"]["sha256"]}
        assert backing(line, line["outputs"]["artifact"]["sha256"]).verified


def test_a_score_line_without_inputs_reads_back_without_them():
    line = {k: v for k, v in _line(10).items() if k != "inputs"}
    assert line["kind"] == "score" and entries.parse(line).to_json() == line


def test_a_reader_of_some_kinds_is_not_stopped_by_a_bad_line_of_another(tmp_path):
    from kvgraft_cli.ledger import log

    path = tmp_path / "l.jsonl"
    log.append(path, "graft", {"inputs": {"artifact": {"sha256": "0" * 64}}, "outputs": {}})  # no suffix_ids...
    entries.write(path, _sample(ScoreEntry))
    with pytest.raises(EntryError, match=r"l\.jsonl:1: a graft entry without inputs\.suffix_ids"):
        entries.read(path)
    (score,) = entries.read(path, (ScoreEntry,))
    assert isinstance(score, ScoreEntry) and score.lineno == 2


def test_an_import_line_with_one_junk_artifact_keeps_the_others():
    from kvgraft_cli.ledger.entries import ImportEntry
    from kvgraft_cli.runs.bundle import recorded_by

    e = _sample(ImportEntry)
    good = {"sha256": "cd" * 32}
    line = dict(e.to_json(), kind="import")
    line["outputs"] = dict(line["outputs"], **{"artifact." + "cd" * 32: good, "artifact." + "ef" * 32: "junk"})
    typed = entries.parse(line)
    assert set(typed.artifacts) == {"cd" * 32} and typed.to_json() == line
    assert recorded_by(line) == {"cd" * 32}
