"""scripts/bench_widening.py in miniature: two small stores filled with real deposits, measured, the table printed;
a second run with --reuse deposits nothing and measures the same stores."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

from kvgraft_cli.config.profiles import environ_without_pins


def test_bench_widening_miniature(tmp_path):
    root = tmp_path / "stores"
    args = [sys.executable, str(REPO / "scripts" / "bench_widening.py"), "--store-root", str(root),
            "--sizes", "1500", "4000", "--chars", "300", "400", "--queries", "6", "--repeat", "1",
            "--solve-repeat", "1", "--chunk", "4", "--math500", ""]
    p = subprocess.run(args + ["--fill-only"], capture_output=True, text=True, env=environ_without_pins(), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "projected:" in p.stdout
    # Not empty: refused without --reuse; with it, the stores are reused (nothing deposited) and measured.
    p = subprocess.run(args, capture_output=True, text=True, env=environ_without_pins(), timeout=300)
    assert p.returncode != 0 and "--reuse" in p.stderr
    p = subprocess.run(args + ["--reuse", "--json-out", str(tmp_path / "w.json")], capture_output=True, text=True,
                       env=environ_without_pins(), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "full (reused)" in p.stdout and "| **ratio" in p.stdout
    data = json.loads((tmp_path / "w.json").read_text())
    small, large = (data["rows"][str(n)] for n in data["sizes"])
    assert 1500 <= small["tokens"] < large["tokens"] and large["tokens"] >= 4000
    assert small["hits"] == {"exact": 3, "related": 3} and large["hits"] == small["hits"]
    assert small["solve_peak_rss_mb"] > 50 and data["ratios"]["graft_p50_ms"] > 0
    # Every deposit is in its store's ledger; the smaller store is a prefix of the larger one's deposit order.
    ledgers = [[json.loads(x) for x in (root / f"s{n}.ledger.jsonl").read_text().splitlines()] for n in (1500, 4000)]
    ids = [[e["inputs"]["record"]["id"] for e in led if e["kind"] == "deposit"] for led in ledgers]
    assert ids[0] == ids[1][:len(ids[0])] and len(ids[0]) == small["artifacts"]
