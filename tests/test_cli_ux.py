"""A CLI people enjoy (issue 11, section 5): escaped model text, torch-free quick commands, `ledger log`, whole
hashes in redirected tables, tidy help, the short-prefix message, no `.lock` file left behind, `kvgraft inspect`."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import unicodedata

import pytest
from conftest import EXAMPLES, REPO, deposit_here, every_help, run_cli

REFERENCE = REPO / "ledger" / "reference.jsonl"
HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


@pytest.fixture(scope="module")
def deposited(tmp_path_factory, engine):
    """A working folder with the first two examples deposited (store and ledger in it, as a user has; deposited in
    this process, the same bytes the CLI writes)."""
    d = tmp_path_factory.mktemp("ux")
    deposit_here(engine, d, str(EXAMPLES), limit=2)
    return d


def _artifacts(d):
    return sorted((d / "kvgraft-store" / "objects").glob("*/*.kvg"))


# -- 1. model text is escaped ------------------------------------------------------------------------------------


def test_printable_escapes_what_a_terminal_would_act_on():
    from kvgraft_cli.cli._output import cell, printable

    assert printable("plain \\boxed{5} text") == "plain \\boxed{5} text"
    assert printable("bell\x07 esc\x1b[31m cr\r nul\x00") == "bell\\x07 esc\\x1b[31m cr\\r nul\\x00"
    assert printable("rtl\u202eoverride zw\u200b sep\u2028") == "rtl\\u202eoverride zw\\u200b sep\\u2028"
    assert printable("two\nlines\tand tab") == "two\nlines\tand tab"
    assert printable("two\nlines", newlines=False) == "two\\nlines"
    assert printable("caf\u00e9 \u00fc \u4e2d \ufffd") == "caf\u00e9 \u00fc \u4e2d \ufffd"  # printable text is kept
    c = cell("[red]x[/] \x07")
    assert c.plain == "[red]x[/] \\x07"  # a Text: never read as markup


def test_graft_escapes_the_random_models_control_characters(deposited):
    r = json.loads(run_cli("graft", "sum-1", "-n", "4", "--json", cwd=deposited, check_rc=0).stdout)
    raw = [c for c in r["text"] if unicodedata.category(c) == "Cc"]
    assert raw, "premise: the random default model decodes to control characters here"
    p = run_cli("graft", "sum-1", "-n", "4", cwd=deposited, check_rc=0)
    assert not [c for c in p.stdout + p.stderr if unicodedata.category(c) == "Cc" and c != "\n"]
    from kvgraft_cli.cli._output import printable

    assert printable(r["text"]) in p.stdout and "\\x" in p.stdout


# -- 2. the quick commands never load torch ----------------------------------------------------------------------

HEAVY_PROBE = """
import json, sys
sys.argv = ["kvgraft"] + sys.argv[1:]
from kvgraft_cli.cli.app import main
try:
    main()
except SystemExit:
    pass
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "safetensors", "tokenizers"})
sys.stderr.write("HEAVY=" + json.dumps(heavy) + "\\n")
"""


@pytest.mark.parametrize(
    "args", [["--help"], ["verify", str(REFERENCE)], ["ledger", "log", str(REFERENCE)], ["inspect", "@artifact"]]
)
def test_quick_commands_do_not_import_torch(deposited, args):
    args = [str(_artifacts(deposited)[0]) if a == "@artifact" else a for a in args]
    p = subprocess.run(
        [sys.executable, "-c", HEAVY_PROBE, *args], cwd=deposited, capture_output=True, text=True, timeout=120
    )
    heavy = json.loads(p.stderr.rsplit("HEAVY=", 1)[1])
    assert heavy == [], (args, heavy)


# -- 3. ledger log ---------------------------------------------------------------------------------------------------


def test_ledger_log_lists_filters_and_prints_json(tmp_path):
    lines = [json.loads(x) for x in REFERENCE.read_text().splitlines()]
    rows = json.loads(run_cli("ledger", "log", str(REFERENCE), "--json", cwd=tmp_path, check_rc=0).stdout)["entries"]
    assert [r["seq"] for r in rows] == [e["seq"] for e in lines]
    assert [r["kind"] for r in rows] == [e["kind"] for e in lines]
    first_deposit = next(r for r in rows if r["kind"] == "deposit")
    assert first_deposit["outputs"]["artifact"] == lines[first_deposit["seq"]]["outputs"]["artifact"]["sha256"]
    assert first_deposit["manifest"]["sha256"] == lines[first_deposit["seq"]]["manifest"]["sha256"]
    score = next(r for r in rows if r["kind"] == "score")
    assert re.match(r"\d+/\d+ correct", score["summary"])

    def seqs(*args):
        p = run_cli("ledger", "log", str(REFERENCE), "--json", *args, cwd=tmp_path, check_rc=0)
        return [r["seq"] for r in json.loads(p.stdout)["entries"]]

    assert seqs("--kind", "replay") == [e["seq"] for e in lines if e["kind"] == "replay"]
    assert seqs("--kind", "score", "--kind", "replay") == [e["seq"] for e in lines if e["kind"] in ("score", "replay")]
    assert seqs("--from-seq", "30") == seqs("--since-seq", "30") == list(range(30, len(lines)))
    newest = lines[-1]["manifest"]["sha256"]
    assert seqs("--manifest", newest[:8]) == [e["seq"] for e in lines if e.get("manifest", {}).get("sha256") == newest]
    assert seqs("--kind", "deposit", "--last", "2") == [e["seq"] for e in lines if e["kind"] == "deposit"][-2:]
    p = run_cli("ledger", "log", str(REFERENCE), "--manifest", "zz", cwd=tmp_path, check_rc=2)
    assert "--manifest" in p.stderr


def test_ledger_log_lists_a_line_whose_kind_is_not_a_string(tmp_path):
    ledger = tmp_path / "odd.jsonl"
    ledger.write_text('{"kind": ["x"], "seq": 0}\n{"kind": {"a": 1}, "seq": 1}\n')
    rows = json.loads(run_cli("ledger", "log", str(ledger), "--json", cwd=tmp_path, check_rc=0).stdout)["entries"]
    assert [(r["seq"], r["kind"], r["outputs"]) for r in rows] == [(0, ["x"], {}), (1, {"a": 1}, {})]


def test_ledger_log_redirected_keeps_every_hash_whole(tmp_path):
    p = run_cli("ledger", "log", str(REFERENCE), cwd=tmp_path, check_rc=0)
    last = json.loads(REFERENCE.read_text().splitlines()[-1])
    assert any(
        last["inputs"]["prereg"]["sha256"] in line and last["manifest"]["sha256"] in line and last["kind"] in line
        for line in p.stdout.splitlines()
    ), p.stdout  # whole, on the entry's own line


def test_prereg_make_on_a_mixed_ledger_points_at_ledger_log(tmp_path):
    p = run_cli("prereg", "make", str(REFERENCE), "--target", "t", "-o", "p.yaml", cwd=tmp_path, check_rc=2)
    assert "manifests" in p.stderr and "kvgraft ledger log" in p.stderr


# -- 4. no truncated values when redirected -----------------------------------------------------------------------


def test_store_list_redirected_keeps_full_hashes_on_one_line(deposited):
    p = run_cli("store", "list", cwd=deposited, check_rc=0)
    names = {a.stem for a in _artifacts(deposited)}
    found = {h for line in p.stdout.splitlines() for h in HEX64.findall(line)}
    assert names <= found, p.stdout
    assert "…" not in p.stdout


# -- 5. help text, prefixes, replay and matrix options -----------------------------------------------------------


def test_help_has_no_type_placeholders_and_documents_options():
    helps = {cmd: h["rendered"] for cmd, h in every_help(200).items()}
    assert {"", "ledger log", "inspect", "store list", "replay", "matrix"} <= set(helps)
    for cmd, text in helps.items():
        assert "<bool>" not in text, cmd
        assert not re.search(r"\{[a-z_]+\}", text), (cmd, re.findall(r"\{[a-z_]+\}", text))
        usage = next(line for line in text.splitlines() if "Usage:" in line).split("[OPTIONS]")[-1]
        assert usage == usage.upper(), (cmd, usage)  # PROBLEMS, [LEDGER]: placeholders in capitals
    assert re.search(r"--limit\s+<int range> \[x>=1\]\s+Show only the first N", helps["store list"])
    for cmd in ("graft", "probe", "inspect"):
        assert "at least 6 hex" in " ".join(helps[cmd].split()), cmd
    # replay runs the manifest its prereg names (hash pinned): no --manifest option, and its help says why.
    assert not re.search(r"│\s+--manifest\b", helps["replay"]) and "no --manifest" in " ".join(helps["replay"].split())


def test_choice_enums_offer_what_the_config_and_the_artifacts_know():
    from kvgraft_cli.artifacts.container import CODECS
    from kvgraft_cli.artifacts.identity import SCHEMES
    from kvgraft_cli.cli import _common as c
    from kvgraft_cli.config import profiles

    def values(enum):
        return [m.value for m in enum]

    assert values(c.Profile) == list(profiles.PROFILES)
    assert values(c.Device) == list(profiles.DEVICES)
    assert values(c.Dtype) == list(profiles.DTYPES)
    assert values(c.Attn) == list(profiles.ATTN_IMPLEMENTATIONS)
    assert values(c.SdpaBackend) == list(profiles.SDPA_BACKENDS)
    assert values(c.Weights) == list(profiles.WEIGHTS)
    assert sorted(values(c.Identity)) == sorted(SCHEMES)
    assert values(c.Codec) == ["auto", *CODECS]


def test_too_short_a_prefix_says_so(deposited):
    sha = _artifacts(deposited)[0].stem
    for args in (["graft", sha[:5]], ["inspect", sha[:5]]):
        p = run_cli(*args, cwd=deposited, check_rc=2)
        assert "too short (need >= 6 hex characters)" in p.stderr, p.stderr
        assert "no artifact" not in p.stderr
    p = run_cli("inspect", sha[:6], "--json", cwd=deposited, check_rc=0)
    assert json.loads(p.stdout)["sha256"] == sha


# -- 6. no lock file left in the working folder ------------------------------------------------------------------


def test_no_lock_file_is_left_beside_the_ledger(deposited, tmp_path):
    assert not list(deposited.rglob("*.lock")), list(deposited.rglob("*.lock"))
    from kvgraft_cli.ledger import log as ledger

    p = tmp_path / "l.jsonl"
    ledger.append(p, "test", {"a": 1})
    with open(p, "ab") as f:
        f.write(b'{"torn')
    assert ledger.repair(p) == len(b'{"torn')
    ledger.append(p, "test", {"a": 2})
    assert sorted(x.name for x in tmp_path.iterdir()) == ["l.jsonl"]


# -- 8. kvgraft inspect ----------------------------------------------------------------------------------------------


def test_inspect_shows_the_header(deposited):
    path = _artifacts(deposited)[0]
    info = json.loads(run_cli("inspect", str(path), "--json", cwd=deposited, check_rc=0).stdout)
    from kvgraft_cli.artifacts.format import read_file

    payload, art = read_file(path, expected_sha256=path.stem)
    assert info["num_tokens"] == art.num_tokens and info["start_position"] == 0 and info["parent_sha256"] is None
    assert info["link"] == "root" and info["dtype"] == art.meta["dtype"]
    assert [l["kind"] for l in info["layers"]] == [l.kind for l in art.layers]
    assert [l["window"] for l in info["layers"]] == [l.sliding_window for l in art.layers]
    for l, st in zip(info["layers"], art.layers):
        if st.kind != "empty":
            assert l["kept"] == st.keys.shape[2] and l["head_dim"] == st.keys.shape[3]
    assert info["model_sha256"] == art.meta["model_sha256"] and info["compute_sha256"] == art.meta["manifest_sha256"]
    assert info["payload_bytes"] == len(payload) and info["file_bytes"] == path.stat().st_size
    assert info["compression_ratio"] == round(len(payload) / path.stat().st_size, 4)
    assert info["sha256"] == path.stem and info["identity_checked"] is False
    checked = json.loads(run_cli("inspect", str(path), "--hash", "--json", cwd=deposited, check_rc=0).stdout)
    assert checked["sha256"] == path.stem and checked["identity_checked"] is True
    human = run_cli("inspect", "sum-1", cwd=deposited, check_rc=0).stdout  # a problem id, through the store
    assert "root" in human and "sliding" in human and info["model_sha256"] in human


def _kvg(payload: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(write_content_size=True, write_checksum=True).compress(payload)


def test_inspect_a_chain_link_and_refusals(deposited, tmp_path):
    from kvgraft_cli.artifacts.payload import read_payload

    src = _artifacts(deposited)[0]
    payload = bytes(read_payload(src))
    (n,) = struct.unpack("<Q", payload[:8])
    header = json.loads(payload[8 : 8 + n])
    meta = header["__metadata__"]
    # A consistent link: sliding layers have seen its start's tokens too (full layers keep only its own).
    seen = [c if c is None else c + 100 for c in json.loads(meta["cumulative_lengths"])]
    meta.update(
        parent_sha256="ab" * 32, start_position="100", cumulative_lengths=json.dumps(seen, separators=(",", ":"))
    )
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    link = tmp_path / "link.kvg"
    link.write_bytes(_kvg(struct.pack("<Q", len(text)) + text + payload[8 + n :]))
    info = json.loads(run_cli("inspect", str(link), "--json", cwd=tmp_path, check_rc=0).stdout)
    assert info["link"] == "chain link" and info["parent_sha256"] == "ab" * 32 and info["start_position"] == 100
    out = run_cli("inspect", str(link), cwd=tmp_path, check_rc=0).stdout
    assert "continues " + "ab" * 32 in out and "positions 100.." in out

    # Not an artifact: exit 2.
    (tmp_path / "notes.kvg").write_text("hello\n")
    p = run_cli("inspect", str(tmp_path / "notes.kvg"), cwd=tmp_path, check_rc=2)
    assert "not a .kvg artifact" in p.stderr
    for name, meta in {"plain.kvg": b'{"a":{}}', "other.kvg": b'{"__metadata__":{"format":"x"}}'}.items():
        (tmp_path / name).write_bytes(_kvg(struct.pack("<Q", len(meta)) + meta))
        p = run_cli("inspect", str(tmp_path / name), cwd=tmp_path, check_rc=2)
        assert "not a kvgraft artifact" in p.stderr, p.stderr
    run_cli("inspect", str(tmp_path / "missing.kvg"), cwd=tmp_path, check_rc=2)

    # Damaged: exit 1.
    for name, data in {
        "badjson.kvg": _kvg(struct.pack("<Q", n) + b"{" * n + payload[8 + n :]),
        "badlen.kvg": _kvg(struct.pack("<Q", 1 << 40) + payload[8:]),
        "cut.kvg": src.read_bytes()[:40],
        "empty.kvg": b"",
    }.items():
        (tmp_path / name).write_bytes(data)
        p = run_cli("inspect", str(tmp_path / name), cwd=tmp_path, check_rc=1)
        assert p.stderr.startswith("Error: ") and len(p.stderr.strip().splitlines()) == 1, (name, p.stderr)

    # --hash notices a payload that does not match the file's name.
    fake = tmp_path / ("0" * 64 + ".kvg")
    shutil.copy(src, fake)
    run_cli("inspect", str(fake), cwd=tmp_path, check_rc=0)
    p = run_cli("inspect", str(fake), "--hash", cwd=tmp_path, check_rc=1)
    assert "does not match" in p.stderr


def test_upper_case_hashes_resolve_and_an_absent_kind_is_named(deposited, tmp_path):
    from kvgraft_cli.store.local import Store

    sha = _artifacts(deposited)[0].stem
    with Store(deposited / "kvgraft-store", create=False) as s:
        assert s.resolve(sha.upper()) == sha and s.resolve(sha[:10].upper()) == sha
    r = run_cli("ledger", "log", str(deposited / "kvgraft-ledger.jsonl"), "--kind", "depsit", cwd=tmp_path, check_rc=0)
    assert "no entry of kind depsit here; this ledger's kinds: deposit" in r.stderr
