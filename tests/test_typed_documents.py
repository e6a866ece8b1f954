"""The manifest is read through its typed sections (config.sections) everywhere but config/: a grep a reader can
repeat (`grep -rnE 'manifest\\.data\\b' kvgraft_cli scripts`), and the sections' values and records checked against
the document they were made from."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import pytest
from source_grep import TOPS, grep_sources

from kvgraft_cli.config.manifest import load_manifest
from kvgraft_cli.config.sections import SECTIONS, DecodeSection, PromptSection

ROOT = Path(__file__).resolve().parents[1]
# A manifest's document read by key: `x.manifest.data`, `m.data` (the name every run gives its manifest), or
# `.data["model"]` and the other section names on anything.
DOCUMENT_READ = re.compile(
    r"manifest\.data\b|\bm\.data\b|load_manifest\([^)]*\)\.data\b"
    r"|\.data\[[\"'](?:model|runtime|prefill|prompt|input|decode|paths|artifact)[\"']\]"
)


def document_reads(root: Path) -> list[str]:
    """``path:line: text`` of every read of a manifest's document outside config/, under ``root``'s kvgraft_cli/,
    scripts/ and benchmarks/."""
    return grep_sources(root, DOCUMENT_READ, "config")


def test_nothing_outside_config_reads_the_manifest_by_key():
    assert document_reads(ROOT) == []


def test_the_grep_sees_a_read_by_key(tmp_path):
    """Can fail: a copy with one read by key put back is named, file and line."""
    for top in TOPS:
        (tmp_path / top).mkdir()
    (tmp_path / "kvgraft_cli" / "x.py").write_text('a = 1\nn = engine.manifest.data["decode"]["max_new_tokens"]\n')
    (tmp_path / "scripts" / "y.py").write_text(
        'd = eng.data["prefill"]\nok = response.data\nt = load_manifest(path).data.get("runtime")\n'
    )
    assert document_reads(tmp_path) == [
        'kvgraft_cli/x.py:2: n = engine.manifest.data["decode"]["max_new_tokens"]',
        'scripts/y.py:1: d = eng.data["prefill"]',
        'scripts/y.py:3: t = load_manifest(path).data.get("runtime")',
    ]


@pytest.mark.parametrize(
    "path", sorted(p for p in (ROOT / "manifests").glob("*.yaml") if ".overlay." not in p.name) + [None], ids=str
)
def test_each_section_holds_what_the_document_says(path):
    """Every shipped manifest: each section's fields are the document's values (defaults where it is silent),
    and as_written gives the section back key for key (what the ledger records of it)."""
    m = load_manifest(path)
    for cls in SECTIONS:
        section = getattr(m, cls.name)
        written = m.data.get(cls.name) or {}
        assert section.as_written() == written
        for key, value in written.items():
            have = getattr(section, key)
            plain = list(have) if isinstance(have, tuple) else dict(have) if isinstance(have, Mapping) else have
            assert plain == value, (cls.name, key)


def test_defaults_are_said_once():
    d = DecodeSection.from_dict({"max_new_tokens": 512})
    assert (d.budget(exact=False), d.budget(exact=True), d.stop) == (512, 512, ())
    assert DecodeSection.from_dict({"max_new_tokens": 512, "answer_tokens": 32}).budget(exact=True) == 32
    p = PromptSection.from_dict({"add_bos": True, "query": "{query}", "prefix": "{problem}"})
    assert (p.format, p.chat, p.has("format"), p.as_written()) == (
        "text",
        False,
        False,
        {"add_bos": True, "query": "{query}", "prefix": "{problem}"},
    )
    assert p.with_bos([5, 6], 1) == [1, 5, 6] and p.with_bos([5], None) == [5]
    assert p.replace(add_bos=False).with_bos([5], 1) == [5]


def test_sections_are_frozen():
    m = load_manifest(None)
    with pytest.raises(AttributeError):
        m.decode.max_new_tokens = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.runtime.env["MKL_CBWR"] = "AVX2"  # type: ignore[index]


def test_a_manifest_crosses_processes():
    """What a Ray worker or a serve replica receives (runs.workers.ray.context_data: the manifest's own fields, plain
    data) makes the same manifest and sections there."""
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.workers.ray import context_data, context_from_data

    m = load_manifest(ROOT / "manifests" / "smollm2-serve.yaml")
    sent = context_data(RunContext.make(m))
    assert set(sent["manifest"]) == {"data", "source", "file_sha256", "base_dir"}  # no section travels
    back = context_from_data(sent).manifest
    assert back == m and back.prefill == m.prefill and back.prefill.cut_before == ("<|im_start|>",)
    assert back.runtime.env == m.runtime.env and back.prompt.as_written() == m.prompt.as_written()
