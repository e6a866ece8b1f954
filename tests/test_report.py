"""`kvgraft report` (issue 25): one self-contained HTML page whose every number is the ledger's, every ledger value
escaped, plots optional, and an -o that never lands on the ledger or a file kvgraft owns."""

from __future__ import annotations

import hashlib
import html
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import run_cli, run_without_torch

pytestmark = pytest.mark.xdist_group("report")  # one worker builds report_ledger (tests/xdist_groups.py)

LEDGER = "kvgraft-ledger.jsonl"


def _entries(d):
    return [json.loads(line) for line in (d / LEDGER).read_text().splitlines()]


@pytest.fixture(scope="module")
def page(report_ledger, tmp_path_factory):
    """The report of the fixture ledger, with plots: (html text, --json data)."""
    out = tmp_path_factory.mktemp("page") / "report.html"
    p = run_cli("report", "-o", str(out), "--json", cwd=report_ledger, check_rc=0)
    assert "verified" in p.stderr and str(out) in p.stderr
    return out.read_text(), json.loads(p.stdout)


class _Tags(HTMLParser):
    """Every tag and attribute of a page, as a browser's parser sees them (text content is not markup)."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def fetching(self) -> list:
        """Tags or attributes that load or run something: script, link, img, iframe, object, embed, any src=, an
        href that is not a same-page #anchor, event handlers, a style that imports or points at a URL."""
        bad = [t for t, _ in self.tags if t in ("script", "link", "img", "iframe", "object", "embed", "image")]
        for tag, attrs in self.tags:
            for k, v in attrs.items():
                v = v or ""
                if k == "src" or k.startswith("on") or (k.endswith("href") and not v.startswith("#")):
                    bad.append((tag, k, v))
        return bad


def _text(page_html: str) -> str:
    """The page's visible text (tags and inline SVG removed, entities decoded), spaces collapsed."""
    body = re.sub(r"<svg.*?</svg>", " ", page_html, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


def test_every_number_is_the_ledgers(page, report_ledger):
    text, data = page[0], page[1]
    shown = _text(text)
    entries = _entries(report_ledger)
    verify = json.loads(run_cli("verify", "--json", cwd=report_ledger).stdout)
    assert data["verification"]["root"] == verify["root"] and data["verification"]["entries"] == len(entries)
    assert "VERIFIED" in shown and verify["root"] in shown and f"entries {len(entries)}" in shown
    runs = [e for e in entries if e["kind"] == "solve-outputs"]
    assert len(runs) == 2 and len(data["comparisons"]) == 1
    for e in runs:
        t = e["outputs"]["totals"]
        for key in ("accuracy", "wilson95_low", "wilson95_high"):
            assert f"{float(t[key]):.4f}" in shown, (key, t[key])
            assert f'title="{float(t[key])!r}"' in text  # the recorded value in full
        assert f"{t['correct']}/{t['scored']}" in shown
        assert f"{t['decode_tokens']:,}" in shown and f"{t['prefill_tokens']:,}" in shown
    # The per-problem decode tokens are the solve lines' own.
    comp = data["comparisons"][0]
    solves = {
        (e["inputs"]["settings"]["library"], e["inputs"]["record"]["id"]): e["outputs"]["costs"]["decode_tokens"]
        for e in entries
        if e["kind"] == "solve"
    }
    for mode, flag in (("baseline", False), ("library", True)):
        got = {(flag, p["id"]): p["decode_tokens"] for p in comp[mode]["per_problem"]}
        assert got == {k: v for k, v in solves.items() if k[0] == flag} and len(got) == 4
    for e in entries:
        r = e.get("outputs", {}).get("result", {})
        if e["kind"] == "graft-check":
            assert f"{r['sha_equal']}/{r['samples']}" in shown
            assert format(float(r["single_pass_max_abs_diff"]), ".3g") in shown
        if e["kind"] == "probe":
            for o in r["offsets"]:
                assert format(float(o["max_abs_diff"]), ".3g") in shown
                assert format(float(o["unmoved_max_abs_diff"]), ".3g") in shown
        if e["kind"] == "score":
            assert f"{float(r['accuracy']):.4f}" in shown and f"rules {e['inputs']['settings']['rules']}" in shown
            assert e["outputs"]["records"]["sha256"][:16] in shown
        if e["kind"] == "deposit":
            assert e["inputs"]["record"]["id"] in shown and e["outputs"]["artifact"]["sha256"][:16] in shown


def test_every_plot_names_its_model(page, report_ledger):
    text = page[0]
    model = next(e["model"]["sha256"] for e in _entries(report_ledger) if e["kind"] == "probe")
    figures = re.findall(r"<figure>(.*?)</figure>", text, flags=re.S)
    assert len(figures) == 3  # the comparison's bars, its per-problem plot, the probe
    for f in figures:
        assert "<svg" in f
        caption = html.unescape(re.search(r"<figcaption>(.*?)</figcaption>", f, flags=re.S).group(1))
        assert f"model sha256 {model}" in caption and "manifest builtin:default.yaml" in caption


def test_the_page_fetches_nothing(page):
    text = page[0]
    assert "http://" not in text and "https://" not in text  # not even an SVG namespace URL
    assert not re.search(r"@import|url\((?!#)|<script|<link|<iframe", text, flags=re.I)  # url(#clip): local
    assert _Tags(text).fetching() == []
    # The checker sees what it must.
    assert _Tags('<p>x</p><img src="a.png"><a href="https://e.x/">e</a><svg><use href="#a"/></svg>').fetching() == [
        "img",
        ("img", "src", "a.png"),
        ("a", "href", "https://e.x/"),
    ]


def _hostile_ledger(folder, source_ledger):
    """The fixture's ledger with every kind's text fields rewritten by an attacker (lines no longer verify)."""
    evil = '<script>alert(1)</script>"><img src=x onerror=alert(2)> $\\frac{1}{2}$ https://evil.example/x.js'
    lines = []
    for e in _entries(source_ledger):
        if "manifest" in e:
            e["manifest"]["source"] = evil
            e["manifest"].pop("path", None)
        if e["kind"] in ("deposit", "solve"):
            e["inputs"]["record"]["id"] = evil
        if e["kind"] == "deposit":
            e["status"] = evil
        if e["kind"] == "probe":
            e["outputs"]["result"]["method"] = evil
            e["outputs"]["result"]["note"] = evil
        if e["kind"] in ("solve-outputs", "score"):
            for part in ("inputs", "outputs"):
                for d in e[part].values():
                    if isinstance(d, dict) and "path" in d:
                        d["path"] = evil
        lines.append(json.dumps(e, sort_keys=True, separators=(",", ":")))
    (folder / LEDGER).write_text("\n".join(lines) + "\n")


def test_hostile_ledger_text_is_escaped(report_ledger, tmp_path):
    _hostile_ledger(tmp_path, report_ledger)
    p = run_cli("report", LEDGER, "-o", "r.html", "--no-files", cwd=tmp_path)
    assert p.returncode == 1 and p.stderr.splitlines()[-1].startswith(
        "Error: "
    )  # the chain is broken: written, and says so
    text = (tmp_path / "r.html").read_text()
    assert _Tags(text).fetching() == [] and "<script" not in text and "<img" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "NOT VERIFIED" in _text(text)
    assert text.count("<svg") == 3  # a $ in a label is text, not mathtext: every plot is drawn


def test_tables_only_without_matplotlib(report_ledger, tmp_path):
    block = (
        "import sys\nclass B:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'matplotlib' or name.startswith('matplotlib.'):\n"
        "            raise ImportError(name + ' is blocked')\nsys.meta_path.insert(0, B())\n"
        "import importlib.util\n_f = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n.split('.')[0] == 'matplotlib' else _f(n, *a)\n"
        "sys.argv = ['kvgraft'] + sys.argv[1:]\nfrom kvgraft_cli.cli.app import main\nmain()\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", block, "report", "-o", str(tmp_path / "r.html")],
        cwd=report_ledger,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "r.html").read_text()
    assert "<svg" not in text and "pip install 'kvgraft[report]'" in html.unescape(text)
    assert "Graft checks" in text and "max |diff|" in html.unescape(text) and text.count("<table>") >= 5


def test_report_never_loads_torch(report_ledger, tmp_path):
    p = run_without_torch("report", "-o", str(tmp_path / "r.html"), "--no-plots", cwd=report_ledger)
    assert p.returncode == 0, p.stderr
    assert "VERIFIED" in (tmp_path / "r.html").read_text()


def test_refusals_write_nothing(report_ledger, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(report_ledger, work)
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}
    (work / "notes.txt").write_text("mine\n")
    artifact = next((work / "kvgraft-store" / "objects").rglob("*.kvg"))
    cases = [
        (["report", "missing.jsonl", "-o", "r.html"], "ledger not found"),
        (["report", "-o", LEDGER], "is the ledger"),
        (["report", "-o", "problems.jsonl"], "a file the ledger names"),
        (["report", "-o", "problems.solve.jsonl"], "a file the ledger names"),
        (["report", "-o", str(artifact)], "a file the ledger names"),
        (["report", "-o", "kvgraft-store/new.html"], "inside the store"),
        (["report", "-o", "notes.txt"], "not a kvgraft report"),
        (["report", "-o", "notes.txt/r.html"], "does not exist or is not a folder"),
        (["report", "-o", "kvgraft-store"], "inside the store"),
        (["report", "-o", "."], "is a directory"),
        (["report", "-o", "r.html", "--key", "k.pub"], "--key needs --checkpoint"),
    ]
    for args, why in cases:
        p = run_cli(*args, cwd=work)
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and why in lines[0], (args, p.stderr)
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file() and p.name != "notes.txt"} == before
    assert (work / "notes.txt").read_text() == "mine\n"
    assert not list(work.glob("*.html")) and not list(work.rglob(".*.tmp"))
    # An earlier report is replaced.
    run_cli("report", "-o", "r.html", "--no-plots", cwd=work, check_rc=0)
    run_cli("report", "-o", "r.html", cwd=work, check_rc=0)
    assert "<svg" in (work / "r.html").read_text()


def test_a_ledger_that_does_not_verify_is_reported_and_exits_1(report_ledger, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(report_ledger, work)
    (work / "problems.solve.jsonl").write_text("changed\n")
    p = run_cli("report", "-o", "r.html", "--no-plots", cwd=work)
    assert p.returncode == 1 and "does not match" in p.stderr and "r.html" in p.stderr
    shown = _text((work / "r.html").read_text())
    assert "NOT VERIFIED" in shown and "2 mismatched" in shown  # named by the solve run and its score


def test_checkpoint_is_shown(report_ledger, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(report_ledger, work)
    run_cli("ledger", "keygen", "lab", cwd=work, check_rc=0)
    run_cli("ledger", "checkpoint", "--key", "lab.key", "-o", "cp.txt", cwd=work, check_rc=0)
    p = run_cli(
        "report", "-o", "r.html", "--checkpoint", "cp.txt", "--key", "lab.pub", "--no-plots", cwd=work, check_rc=0
    )
    n = len(_entries(work))
    assert f"kvgraft-ledger @ {n} lines, signed by lab" in _text((work / "r.html").read_text()), p.stderr
    refused = run_cli("report", "-o", "cp.txt", "--checkpoint", "cp.txt", cwd=work)
    assert refused.returncode == 2 and "kvgraft owns" in refused.stderr


def test_the_reference_ledger_with_its_signed_checkpoint(tmp_path):
    """The project's own ledger: older score lines (score rules 1, no grader recorded) read as the scorer reads them,
    and the committed checkpoint checked against the committed key."""
    from conftest import REPO

    ref = REPO / "ledger"
    p = run_cli(
        "report",
        str(ref / "reference.jsonl"),
        "-o",
        "r.html",
        "--checkpoint",
        str(ref / "checkpoint.txt"),
        "--key",
        str(ref / "kvgraft.pub"),
        "--no-plots",
        "--json",
        cwd=tmp_path,
        check_rc=0,
    )
    data = json.loads(p.stdout)
    shown = _text((tmp_path / "r.html").read_text())
    cp = data["verification"]["checkpoint"]
    assert f"{cp['origin']} @ {cp['size']} lines, signed by {cp['signed_by'][0]}" in shown
    assert [(s["grader"], s["rules"]) for s in data["scores"]] == [("exact", "1")] * 3
    assert "rules 1, extractor 1" in shown and len(data["deposits"]) == data["kinds"]["deposit"] == 21


def test_values_of_the_wrong_type_are_listed_not_fatal():
    """A ledger line whose values are not what its kind records is listed with the reason; infinite and NaN values
    are shown in tables and left out of plots; the page is still drawn (in-process: no CLI)."""
    import warnings
    from pathlib import Path

    from kvgraft_cli.audit.verify import VerifyReport
    from kvgraft_cli.report.collect import collect
    from kvgraft_cli.report.render import render

    pf = {"path": "p.jsonl", "sha256": "a" * 64}
    entries = [
        {"kind": "solve", "inputs": {"problems_file": 5}},
        {
            "kind": "solve-outputs",
            "mode": "library",
            "inputs": {"problems_file": pf, "settings": {}},
            "outputs": {
                "outputs": pf,
                "totals": {
                    "accuracy": "inf",
                    "wilson95_low": "nan",
                    "wilson95_high": "-inf",
                    "decode_tokens": 5,
                    "correct": 1,
                    "scored": 2,
                },
            },
        },
        {
            "kind": "solve-outputs",
            "mode": "baseline",
            "inputs": {"problems_file": pf, "settings": {}},
            "outputs": {"outputs": pf, "totals": {"accuracy": "0.5", "decode_tokens": -3}},
        },
        {
            "kind": "probe",
            "inputs": {"artifact": {"sha256": "b" * 64}, "offsets": [0, 3, 8], "samples": 1, "suffixes": pf},
            "outputs": {
                "reference_logits": pf,
                "result": {
                    "offsets": [
                        {"offset": 0, "max_abs_diff": "inf"},
                        {"offset": 3, "max_abs_diff": "nan"},
                        {"offset": 8, "max_abs_diff": "1e-300"},
                    ]
                },
            },
        },
        {"kind": "probe", "outputs": {"result": {"offsets": "x"}}},
        {"kind": "graft-check", "inputs": {"artifact": "str"}, "outputs": {"result": []}},
        {"kind": "deposit", "inputs": {"record": {"id": ["x"]}, "token_ids": {"count": True}}},
        {"kind": "score", "inputs": {"settings": {"rules": ["x"]}}, "outputs": {"result": {"accuracy": {}}}},
        {"kind": 5},
        [1, 2],
    ]
    data = "".join(json.dumps(e) + "\n" for e in entries).encode() + b"{torn"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = collect(Path("x.jsonl"), data, VerifyReport("x.jsonl").to_json())
        page = render(report, True)
    assert [(s["line"], s["kind"]) for s in report.skipped] == [
        (1, "solve"),  # not drawn; its run's totals still are
        (5, "probe"),
        (6, "graft-check"),
        (7, "deposit"),
        (8, "score"),
    ]
    assert report.unreadable == [10] and report.kinds["(no kind)"] == 1 and len(report.comparisons) == 1
    assert (
        page.count("<svg") == 2 and "a deposit entry without inputs.problems_file" in page and ">inf<" in page
    )  # no per-problem lines: no plot


def test_the_page_names_files_relative_to_the_ledger(tmp_path):
    """A manifest given by absolute path is recorded with that path (manifest.source); the page, which is shared,
    names it relative to the ledger's folder, and the ledger given by absolute path by its file name: no path of
    this machine's temporary folder anywhere on the page."""
    from conftest import EXAMPLES

    from kvgraft_cli.config.manifest import data_dir

    (tmp_path / "manifests").mkdir()
    manifest = (tmp_path / "manifests" / "tiny.yaml").resolve()
    shutil.copyfile(data_dir() / "default.yaml", manifest)
    (tmp_path / "problems.jsonl").write_text("".join(line + "\n" for line in EXAMPLES.read_text().splitlines()[:2]))
    run_cli("deposit", "problems.jsonl", "-m", str(manifest), cwd=tmp_path, check_rc=0)
    run_cli("probe", "--offsets", "0,1", "--samples", "1", "-m", str(manifest), cwd=tmp_path, check_rc=0)
    entries = _entries(tmp_path)
    assert {e["manifest"]["source"] for e in entries} == {str(manifest)}  # what the page must not show
    run_cli("report", str(tmp_path.resolve() / LEDGER), "-o", "r.html", cwd=tmp_path, check_rc=0)
    text = (tmp_path / "r.html").read_text()
    for folder in {str(tmp_path), str(tmp_path.resolve())}:
        assert folder not in text and html.escape(folder) not in text
    figures = re.findall(r"<figure>(.*?)</figure>", text, flags=re.S)
    assert len(figures) == 1  # the probe's
    caption = html.unescape(re.search(r"<figcaption>(.*?)</figcaption>", figures[0], flags=re.S).group(1))
    assert f"manifest manifests/tiny.yaml sha256 {entries[0]['manifest']['sha256']}" in caption
    assert "model tiny-gemma4-portable-cpu (builtin:tiny-gemma4)" in caption  # the manifest was read beside the ledger
    assert f"<title>kvgraft report: {LEDGER}</title>" in text


def test_shown_path_never_shows_an_absolute_path(tmp_path):
    from kvgraft_cli.report.collect import shown_path

    assert shown_path(None, tmp_path) is None
    assert shown_path("builtin:default.yaml", tmp_path) == "builtin:default.yaml"
    assert shown_path("../manifests/m.yaml", tmp_path) == "../manifests/m.yaml"  # as recorded: already relative
    assert shown_path(str(tmp_path / "sub" / "m.yaml"), tmp_path) == str(Path("sub") / "m.yaml")
    assert shown_path("C:\\Users\\alice\\runs\\m.yaml", tmp_path) == "m.yaml"  # another machine's: its name
    assert shown_path("\\\\server\\share\\m.yaml", tmp_path) == "m.yaml"


# -- served traffic (`kvgraft serve`'s lines, appended here as the server writes them: no server is started) ----------

MODEL = {"sha256": "d7" * 32, "tokenizer_sha256": "43" * 32}
# (hit, finish reason, first-token s, wall s, queue s, grafted, cached, computed, decode, endpoint)
SERVED = [
    ("exact", "stop", 0.010, 0.050, 0.001, 40, 0, 8, 4, "chat"),
    ("exact", "stop", 0.012, 0.060, 0.002, 40, 0, 8, 5, "chat"),
    ("none", "length", 0.300, 0.900, 0.004, 0, 0, 60, 64, "chat"),
    ("plain", "length", 0.200, 0.700, 0.003, 0, 0, 50, 64, "completion"),
    ("plain", "stop", 0.050, 0.300, 0.005, 0, 32, 18, 20, "completion"),
    ("related", "stop", 0.100, 0.400, 0.001, 30, 0, 20, 16, "chat"),
    ("exact", "stop", 0.011, 0.055, 0.007, 40, 0, 8, 4, "chat"),
    ("none", "length", 0.250, 0.800, 0.002, 0, 0, 60, 64, "chat"),
    ("plain", "cancelled", None, 0.020, 0.009, 0, 0, 50, 0, "completion"),  # cancelled while queued
    ("plain", "length", 0.040, 0.500, 0.001, 0, 32, 20, 64, "completion"),
]


def _serve_entry(manifest, hit, finish, first, wall, queue, grafted, cached, computed, decode, endpoint, chunk=16):
    """A `serve` line shaped as kvgraft_cli/serve/answer.py writes it (floats become repr strings on append)."""
    chunks = [format(i, "064x") for i in range(cached // 16)]
    costs = {
        "prompt_tokens": grafted + cached + computed,
        "grafted_tokens": grafted,
        "cached_tokens": cached,
        "prefill_tokens": computed,
        "decode_tokens": decode,
        "wall_s": wall,
        "queue_s": queue,
    }
    outputs = {
        "first_logits": {"sha256": "1" * 64},
        "generated_ids": {"sha256": "2" * 64, "count": decode},
        "output": {"sha256": "3" * 64},
        "finish_reason": finish,
        "costs": costs,
    }
    if first is None:
        del outputs["first_logits"]
    else:
        costs["first_token_s"] = first
    return {
        "manifest": manifest,
        "model": dict(MODEL),
        "environment": {"device": "cpu", "threads": 1},
        "inputs": {
            "request": {"sha256": "4" * 64, "endpoint": endpoint, "log": "kvgraft-ledger.requests.jsonl"},
            "prompt_ids": {"sha256": "5" * 64, "count": grafted + cached + computed},
            "library": {
                "hit": hit,
                "artifacts": ["6" * 64] if grafted else [],
                "chain": ["7" * 64] if grafted else [],
            },
            "prompt_cache": {
                "chunk": chunk,
                "chunks": chunks,
                "deposited": [] if cached else ["8" * 64],
                "refused": [],
            },
            "settings": {"k": 2, "min_score": None, "max_tokens": 64, "stop": []},
        },
        "outputs": outputs,
    }


def _served_ledger(folder, rows=SERVED):
    """A ledger of served requests (manifest x.yaml beside it), then one `replay --served` line; returns the
    manifest record."""
    from kvgraft_cli.config.manifest import data_dir
    from kvgraft_cli.ledger.log import append

    shutil.copyfile(data_dir() / "default.yaml", folder / "x.yaml")
    sha = hashlib.sha256((folder / "x.yaml").read_bytes()).hexdigest()
    manifest = {"source": "x.yaml", "path": "x.yaml", "sha256": sha, "compute_sha256": "c0" * 32}
    for row in rows:
        append(folder / LEDGER, "serve", _serve_entry(manifest, *row))
    replay = {
        "inputs": {"served": {"ledger": LEDGER, "lines_sha256": "9" * 64, "first_seq": 0, "last_seq": 9, "count": 10}},
        "outputs": {"matched": 9, "mismatched": 1},
    }
    append(folder / LEDGER, "replay-served", {"manifest": manifest, "model": dict(MODEL), **replay})
    return manifest


def _report(folder, plots=True):
    """The report of ``folder``'s ledger, in-process: (html text, its visible text, the --json data)."""
    from kvgraft_cli.report import write_report

    data = write_report(folder / LEDGER, folder / "r.html", plots=plots).to_json()
    text = (folder / "r.html").read_text()
    return text, _text(text), data


def test_served_traffic_is_counted_and_its_percentiles_are_recorded_values(tmp_path):
    manifest = _served_ledger(tmp_path)
    text, shown, data = _report(tmp_path)
    assert "VERIFIED" in shown and "NOT VERIFIED" not in shown  # the lines are what the verifier requires
    assert len(data["served"]) == 1 and data["served"][0]["summary"]["requests"] == 10
    section = shown[shown.index("Served ( kvgraft serve )") :]
    assert "tiny-gemma4-portable-cpu: 10 requests (lines 1 to 10; library k 2, min score none;" in section
    assert "prompt cache chunks of 16 tokens)" in section
    assert "by library hit exact 3 (30.0%), related 1 (10.0%), none 2 (20.0%), plain 4 (40.0%)" in section
    assert "by finish reason stop 5 (50.0%), length 4 (40.0%), cancelled 1 (10.0%)" in section
    assert "by endpoint chat 6 (60.0%), completion 4 (40.0%)" in section
    assert "prompt cache 2 of 10 requests restored from it (4 chunks); 8 chunks deposited, 0 refused" in section
    # Tokens: the recorded counts summed (prompt = grafted + restored + computed, each line's own).
    grafted, cached, computed = (sum(r[i] for r in SERVED) for i in (5, 6, 7))
    prompt = grafted + cached + computed
    assert (grafted, cached, computed, prompt) == (150, 64, 302, 516)
    assert f"prompt tokens {prompt:,} 100.0%" in section
    assert f"grafted from the library {grafted} {100 * grafted / prompt:.1f}%" in section
    assert f"restored from the prompt cache {cached} {100 * cached / prompt:.1f}%" in section
    assert f"computed (prefill) {computed} {100 * computed / prompt:.1f}%" in section
    assert f"decode tokens {sum(r[8] for r in SERVED)}" in section
    # Nearest rank over the 9 requests not cancelled: p50 the 5th smallest, p99 the 9th; each cites its line.
    lat = {g["group"]: g for g in data["served"][0]["summary"]["latency"]}
    assert lat["all"]["requests"] == 9
    assert lat["all"]["first_token_s"]["p50"] == {"value": 0.05, "line": 5}
    assert lat["all"]["first_token_s"]["p99"] == {"value": 0.3, "line": 3}
    assert lat["all"]["wall_s"]["p50"] == {"value": 0.4, "line": 6}
    assert lat["library hit: exact"]["first_token_s"]["p50"] == {"value": 0.011, "line": 7}
    assert lat["prompt cache: restored"]["first_token_s"]["p50"] == {"value": 0.04, "line": 10}
    assert lat["prompt cache: restored"]["wall_s"]["p99"] == {"value": 0.5, "line": 10}
    assert "prompt cache: off" not in lat and lat["library hit: plain"]["requests"] == 3  # the cancelled one left out
    assert "all 9 0.0500 0.3000 0.4000 0.9000 0.0020 0.0070" in section
    assert "library hit: exact 3 0.0110 0.0120 0.0550 0.0600 0.0020 0.0070" in section
    assert "prompt cache: restored 2 0.0400 0.0500 0.3000 0.5000 0.0010 0.0050" in section
    assert 'title="0.05 (line 5)"' in text
    # The replay --served line, failed by its mismatch.
    assert f"11 {LEDGER} seq 0 to 9 10 9 1 FAIL 9999999999999999" in section
    # One figure, named by the model and manifest that served the requests.
    figures = re.findall(r"<figure>(.*?)</figure>", text, flags=re.S)
    assert len(figures) == 1 and "<svg" in figures[0]
    caption = html.unescape(re.search(r"<figcaption>(.*?)</figcaption>", figures[0], flags=re.S).group(1))
    assert "First-token seconds of each request not cancelled (1 cancelled)" in caption
    assert f"model tiny-gemma4-portable-cpu (builtin:tiny-gemma4), model sha256 {MODEL['sha256']}" in caption
    assert f"manifest x.yaml sha256 {manifest['sha256']}" in caption
    assert f"compute pin {manifest['compute_sha256'][:16]}" in section


def test_served_lines_of_another_model_are_their_own_group_and_bad_ones_are_listed(tmp_path):
    _served_ledger(tmp_path, SERVED[:2])
    from kvgraft_cli.ledger.log import append

    manifest = json.loads((tmp_path / LEDGER).read_text().splitlines()[0])["manifest"]
    other = _serve_entry(manifest, *SERVED[2], chunk=None)
    other["model"]["sha256"] = "ab" * 32
    append(tmp_path / LEDGER, "serve", other)
    bad = _serve_entry(manifest, *SERVED[3])
    bad["outputs"]["costs"]["wall_s"] = "slow"
    append(tmp_path / LEDGER, "serve", bad)
    text, shown, data = _report(tmp_path, plots=False)
    assert [g["summary"]["requests"] for g in data["served"]] == [2, 1]
    assert data["served"][1]["model"]["model_sha256"] == "ab" * 32
    assert "tiny-gemma4-portable-cpu: 1 request (lines 4 to 4; library k 2, min score none; prompt cache off)" in shown
    assert (
        "prompt cache: off 1 0.3000" in shown
        and "0 of 1 requests restored from it (0 chunks), 1 served without" in shown
    )
    assert data["skipped"] == [{"line": 5, "kind": "serve", "reason": "'slow' is not a number"}]
    assert "[plot: First-token seconds" in shown and "<svg" not in text


def test_served_text_is_escaped(tmp_path):
    evil = '<script>alert(1)</script>"><img src=x onerror=alert(2)> $\\frac{1}{2}$'
    rows = [(evil, evil, 0.1, 0.2, 0.0, 0, 0, 10, 2, evil), *SERVED[:3]]
    _served_ledger(tmp_path, rows)
    lines = [json.loads(line) for line in (tmp_path / LEDGER).read_text().splitlines()]
    lines[-1]["inputs"]["served"]["ledger"] = evil  # the replay-served line's served ledger
    lines[0]["inputs"]["settings"]["min_score"] = evil
    (tmp_path / LEDGER).write_text("".join(json.dumps(e) + "\n" for e in lines))
    text, shown, data = _report(tmp_path)
    assert _Tags(text).fetching() == [] and "<script" not in text and "<img" not in text
    assert text.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 5  # hit, finish, endpoint, min score, ledger
    assert f"{evil} 1 (25.0%)" in shown and text.count("<svg") == 1  # the hit's $ is drawn as text
    assert data["served"][0]["summary"]["by_hit"][evil] == 1


def test_no_served_section_without_served_lines(page):
    text, data = page
    assert data["served"] == [] and data["served_replays"] == []
    assert 'id="served"' not in text and "kvgraft serve" not in text
