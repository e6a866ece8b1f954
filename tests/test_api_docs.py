"""docs/API.md's examples run as written: each ```python block in a fresh Python (a manifest pins torch's flags
before torch is imported), in order, in one folder holding a copy of examples/problems.jsonl. The examples assert
what they claim (graft == fresh by torch.equal, a check's SHA-256 equality, a ledger that verifies), so a broken
API fails here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "API.md"


def examples(text: str) -> list[str]:
    """The ```python blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_api_docs_examples_run(tmp_path):
    blocks = examples(DOC.read_text(encoding="utf-8"))
    assert len(blocks) >= 5
    shutil.copy(ROOT / "examples" / "problems.jsonl", tmp_path / "problems.jsonl")
    for n, code in enumerate(blocks, 1):
        script = tmp_path / f"example_{n}.py"
        script.write_text(code, encoding="utf-8")
        r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"docs/API.md example {n} failed:\n{code}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert (tmp_path / "kvgraft-ledger.jsonl").is_file()


def test_the_public_surface_is_what_the_docs_name():
    """Every name in api.__all__ appears in docs/API.md, and the module imports no torch (a program imports it
    first, then torch, once the manifest's flags are set)."""
    import kvgraft_cli.api as api

    doc = DOC.read_text(encoding="utf-8")
    for name in api.__all__:
        assert name in doc, f"{name} is public but docs/API.md does not name it"
    r = subprocess.run(
        [sys.executable, "-c", "import sys, kvgraft_cli.api; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.strip() == "False", r.stderr
