"""Run-manifests: read, validate (JSON Schema shipped in the package), resolve and write pinned YAML.

A manifest pins everything that decides the bits of a run. Its *compute pin* (:func:`compute_pin`) is the subset
that decides the KV cache bits, hashed canonically; artifacts carry it, so a graft under another pin is refused.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..errors import ManifestError
from ..util.hashing import sha256_bytes, sha256_json
from .gguf import dequantized_dir, is_gguf_path, resolve_gguf
from .sections import (
    SECTIONS,
    ArtifactSection,
    DecodeSection,
    InputSection,
    ModelSection,
    PathsSection,
    PrefillSection,
    PromptSection,
    RuntimeSection,
)

if TYPE_CHECKING:
    from .modelhash import ModelHashes

BUILTIN_PREFIX = "builtin:"
DEFAULT_MANIFEST = "default.yaml"
PLACEHOLDERS_PREFIX = {"id", "problem", "solution", "answer"}
PLACEHOLDERS_QUERY = {"query"}


@dataclass(frozen=True)
class Manifest:
    """A validated manifest and where it came from, read through its typed sections (config.sections).

    ``data`` is the validated document, kept for what config/ computes from it as written (the compute pin, a copy
    with overrides, the YAML written back); code elsewhere reads the sections, which are made once here.
    """

    data: dict[str, Any]
    source: str  # file path, or "builtin:default.yaml"
    file_sha256: str  # SHA-256 of the manifest file's bytes
    base_dir: Path  # folder that relative model paths resolve against
    model: ModelSection = field(init=False, repr=False, compare=False)
    runtime: RuntimeSection = field(init=False, repr=False, compare=False)
    prefill: PrefillSection = field(init=False, repr=False, compare=False)
    prompt: PromptSection = field(init=False, repr=False, compare=False)
    input: InputSection = field(init=False, repr=False, compare=False)
    decode: DecodeSection = field(init=False, repr=False, compare=False)
    paths: PathsSection = field(init=False, repr=False, compare=False)
    artifact: ArtifactSection = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for cls in SECTIONS:  # (artifact is the one optional section)
            object.__setattr__(self, cls.name, cls.from_dict(self.data.get(cls.name) or {}))

    @property
    def name(self) -> str | None:
        """The manifest's ``name`` (None where it gives none)."""
        return self.data.get("name")

    @property
    def model_dir(self) -> Path:
        """The model directory, resolved (builtin:NAME -> the package's data folder; a GGUF -> its dequantized
        checkpoint in the user's cache, which engine.gguf writes when it is missing)."""
        model = self.model
        if is_gguf_path(model.path):
            assert model.gguf_sha256 is not None  # (validation requires it of a GGUF model.path)
            return dequantized_dir(model.gguf_sha256, model.dtype)
        return resolve_model_path(model.path, self.base_dir)

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file model.path names (``package:DIST`` found without importing it), or None for a checkpoint
        directory. InputError when it names one that is not there."""
        path = self.model.path
        return resolve_gguf(path, self.base_dir) if is_gguf_path(path) else None

    def to_dict(self) -> dict[str, Any]:
        """The validated document (a copy), as written: what `manifest show` prints and a YAML dump writes back."""
        return copy.deepcopy(self.data)

    @property
    def prefill_pin(self) -> dict[str, Any]:
        """The prefill schedule as it decides cache bits (:func:`pinned_prefill`), as artifacts name it."""
        return pinned_prefill(self.data["prefill"])

    @property
    def compute_sha256(self) -> str:
        """Hash of the compute pin (see :func:`compute_pin`)."""
        return sha256_json(compute_pin(self.data))

    @property
    def kernels(self) -> str | None:
        """This machine's kernel identity under this manifest (config.kernels): None where its pins name the
        kernels (``portable``, ``avx2``), else the CPU whose kernels compute its bits (``native``)."""
        from .kernels import kernel_identity

        return kernel_identity(self.runtime.env, self.runtime.device)

    @property
    def machine_compute_sha256(self) -> str:
        """The compute identity of what this manifest computes on this machine: :attr:`compute_sha256` where the
        pins name the kernels, else that pin with this machine's kernel identity (config.kernels). Artifacts,
        prompt-cache keys and library keys are made and looked up under it."""
        from .kernels import machine_compute_sha256

        return machine_compute_sha256(self.compute_sha256, self.runtime.env, self.runtime.device)


def data_dir() -> Path:
    """The package's data folder (embedded models and the default manifest)."""
    return Path(str(resources.files("kvgraft_cli") / "data"))


def clip(value: Any, limit: int = 200) -> str:
    """``value`` as text for an error message, cut to ``limit`` characters (``...…(N chars)``): a message quotes
    what it refuses, never megabytes of it."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}…({len(text):,} chars)"


def builtin_models() -> list[str]:
    """The names ``builtin:NAME`` may take: the model directories shipped in the package's data folder."""
    return sorted(p.name for p in data_dir().iterdir() if p.is_dir() and (p / "config.json").is_file())


def builtin_model_dir(name: str) -> Path:
    """The package's model directory ``builtin:NAME`` names; only a known name (never a path: ``builtin:../..``)."""
    known = builtin_models()
    if name not in known:
        raise ManifestError(
            f"unknown builtin model {BUILTIN_PREFIX}{clip(name, 80)}",
            f"builtin models: {', '.join(BUILTIN_PREFIX + k for k in known)}; or give a local path",
        )
    return data_dir() / name


def resolve_model_path(path: str, base_dir: Path) -> Path:
    """Resolve a manifest's model.path: ``builtin:NAME`` (a known name) or a path relative to the manifest's folder."""
    if path.startswith(BUILTIN_PREFIX):
        return builtin_model_dir(path[len(BUILTIN_PREFIX) :])
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base_dir / p)


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    """The manifest JSON Schema shipped in the package."""
    return json.loads((resources.files("kvgraft_cli") / "schemas" / "manifest.schema.json").read_text())


def compute_pin(data: dict[str, Any]) -> dict[str, Any]:
    """The part of a manifest that decides the KV cache bits of a prefix.

    Excluded on purpose: the model's local path (machine-specific; the hash pins the model), the name, input field
    names, the query template, decode settings and output paths. None of them changes a deposited cache.
    """
    model = {k: v for k, v in data["model"].items() if k != "path"}
    return {
        "model": model,
        "runtime": data["runtime"],
        "prefill": pinned_prefill(data["prefill"]),
        "prompt": pinned_prompt(data["prompt"]),
    }


CHAT_PREFIX_KEYS = ("system", "user", "assistant")


def pinned_prompt(prompt: dict[str, Any]) -> dict[str, Any]:
    """The prompt settings that decide a deposited prefix's tokens: BOS and the prefix template (text format, as
    every manifest before the chat format pinned them), or the format and the turns' templates (chat; the chat
    template itself is pinned by the tokenizer hash). The question's templates decide no cache bit."""
    if prompt.get("format", "text") == "chat":
        return {"add_bos": prompt["add_bos"], "format": "chat", **{k: prompt.get(k) for k in CHAT_PREFIX_KEYS}}
    return {"add_bos": prompt["add_bos"], "prefix": prompt.get("prefix")}


def pinned_prefill(prefill: dict[str, Any]) -> dict[str, Any]:
    """The prefill schedule as it decides cache bits. Under ``invariant`` every token is computed in a forward of
    its own, so how calls are grouped (``chunk_size``) changes no bit and is left out: artifacts deposited with one
    chunk size graft into runs that use another. ``single`` and ``chunked`` are pinned whole."""
    if prefill.get("schedule") == "invariant":
        return {"schedule": "invariant"}
    return prefill


MAX_YAML_DEPTH = 32  # a manifest nests 4 levels, a prereg 6
MAX_YAML_CHARS = 4 << 20  # a manifest is about 2 KB, a prereg of 500 solved problems about 100 KB


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML keeps the last one silently), anchors and aliases (a 2 KB
    file of nested aliases expands to gigabytes: a "billion laughs"), and nesting deeper than MAX_YAML_DEPTH."""

    _depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            what = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise yaml.composer.ComposerError(
                None,
                None,
                f"YAML {what}{clip(event.anchor, 40)} is not allowed here (anchors and aliases are "
                "refused: write the value out)",
                event.start_mark,
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", event.start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {clip(repr(key), 80)} (first on line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _line_of(root: yaml.Node | None, path: list) -> int | None:
    """1-based line of the YAML node at a JSON path (the deepest node that exists)."""
    node, line = root, None
    for part in path:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == part:
                    nxt, line = v, k.start_mark.line + 1
                    break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            node = None
    if node is not None:
        line = node.start_mark.line + 1
    return line


def _dotted(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def validate_data(data: Any, source: str, text: str | None = None) -> list[str]:
    """Every problem in a parsed manifest, one line each, with its dotted path (and line when ``text`` is given)."""
    import jsonschema

    root = yaml.compose(text, Loader=_StrictLoader) if text is not None else None
    problems: list[tuple[str, int | None, str]] = []
    validator = jsonschema.Draft202012Validator(schema())
    for err in validator.iter_errors(data):
        path = list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = set(err.schema.get("properties", {}))
            for key in sorted(set(err.instance) - allowed, key=str):
                problems.append(
                    (
                        clip(_dotted(path + [key]), 120),
                        _line_of(root, path + [key]),
                        f"unknown key (allowed: {', '.join(sorted(allowed))})",
                    )
                )
            continue
        problems.append((clip(_dotted(path), 120), _line_of(root, path), clip(err.message)))
    if isinstance(data, dict):
        problems += [
            (p, _line_of(root, p.split(".")), clip(m))
            for p, m in _template_problems(data) + _model_problems(data) + _prefill_problems(data)
        ]
    problems.sort(key=lambda t: (t[1] or 0, t[0]))
    return [f"{source}:{line}: {path}: {msg}" if line else f"{source}: {path}: {msg}" for path, line, msg in problems]


def _prefill_problems(data: dict) -> list[tuple[str, str]]:
    """``prefill.cut_before`` cuts chunks: only the chunked schedule has any."""
    prefill = p if isinstance(p := data.get("prefill"), dict) else {}
    if "cut_before" in prefill and prefill.get("schedule") != "chunked":
        return [("prefill.cut_before", "only the chunked schedule cuts chunks: remove it, or use schedule chunked")]
    return []


def _model_problems(data: dict) -> list[tuple[str, str]]:
    """model.path ``builtin:NAME`` must name a model the package ships (never a path out of it); a GGUF pins its
    SHA-256; ``model.weights: q4`` needs a GGUF, its converted weights' hash and the CPU."""
    model = m if isinstance(m := data.get("model"), dict) else {}
    path = model.get("path")
    if isinstance(path, str) and is_gguf_path(path) and "gguf_sha256" not in model:
        return [
            (
                "model.gguf_sha256",
                f"model.path {clip(path, 80)} is a GGUF: pin its SHA-256 as model.gguf_sha256 "
                "(`kvgraft manifest init` writes it)",
            )
        ]
    weights = model.get("weights", "dequantized")
    if weights != "dequantized":
        runtime = r if isinstance(r := data.get("runtime"), dict) else {}
        if not (isinstance(path, str) and is_gguf_path(path)):
            return [("model.weights", f"weights {clip(weights, 40)} needs a GGUF model.path (the file's own codes)")]
        if "weights_sha256" not in model:
            return [
                (
                    "model.weights_sha256",
                    f"model.weights {clip(weights, 40)}: pin the converted weights' SHA-256 as model.weights_sha256 "
                    "(`kvgraft manifest init --weights q4` writes it)",
                )
            ]
        if runtime.get("device", "cpu") != "cpu":
            return [("model.weights", f"weights {clip(weights, 40)} runs on torch's CPU kernels: device must be cpu")]
    elif "weights_sha256" in model:
        return [("model.weights_sha256", "only for model.weights q4: remove it")]
    if model.get("attn_products", "blas") != "blas" and model.get("attn_implementation") != "grouped":
        return [("model.attn_products", "attention's products are chosen by attn_implementation grouped only")]
    if "kv_dtype" in model:
        runtime = r if isinstance(r := data.get("runtime"), dict) else {}
        if model.get("dtype") != "float32":
            return [("model.kv_dtype", "a 16-bit cache is for a float32 model (model.dtype float32): remove it")]
        if model.get("attn_implementation") != "grouped":
            return [
                (
                    "model.kv_dtype",
                    "a cache narrower than model.dtype needs attn_implementation grouped "
                    "(the kernel that widens it where attention reads it)",
                )
            ]
        if runtime.get("device", "cpu") != "cpu":
            return [("model.kv_dtype", "a cache narrower than model.dtype grows on the CPU only: device must be cpu")]
    if isinstance(path, str) and path.startswith(BUILTIN_PREFIX):
        known = builtin_models()
        if path[len(BUILTIN_PREFIX) :] not in known:
            return [
                (
                    "model.path",
                    f"unknown builtin model {clip(path, 80)} (builtin models: "
                    f"{', '.join(BUILTIN_PREFIX + k for k in known)})",
                )
            ]
    return []


def _template_problems(data: dict) -> list[tuple[str, str]]:
    import string

    out = []
    prompt = p if isinstance(p := data.get("prompt"), dict) else {}
    chat = prompt.get("format", "text") == "chat"
    needed, unused = (("user", "assistant"), ("prefix",)) if chat else (("prefix",), CHAT_PREFIX_KEYS)
    for key in needed:
        if key not in prompt:
            out.append((f"prompt.{key}", f"required for prompt.format {'chat' if chat else 'text'}"))
    for key in unused:
        if key in prompt:
            out.append((f"prompt.{key}", f"not used by prompt.format {'chat' if chat else 'text'}: remove it"))
    for key, allowed in (
        ("prefix", PLACEHOLDERS_PREFIX),
        ("user", PLACEHOLDERS_PREFIX),
        ("assistant", PLACEHOLDERS_PREFIX),
        ("query", PLACEHOLDERS_QUERY),
        ("query_exact", PLACEHOLDERS_QUERY),
    ):  # system and answer_prefix are literal text
        tmpl = prompt.get(key)
        if not isinstance(tmpl, str):
            continue
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(tmpl) if f is not None}
        except ValueError as e:
            out.append((f"prompt.{key}", f"bad template ({e}); write literal braces as {{{{ and }}}}"))
            continue
        bad = sorted(names - allowed)
        if bad:
            out.append((f"prompt.{key}", f"unknown placeholder(s) {bad}; allowed: {sorted(allowed)}"))
    return out


def parse_text(text: str, source: str) -> Any:
    """Parse manifest YAML, turning syntax errors into a ManifestError that names file and line. Anchors, aliases,
    nesting deeper than MAX_YAML_DEPTH and files over MAX_YAML_CHARS are refused (PyYAML takes ~100 bytes of memory
    per byte of YAML)."""
    if len(text) > MAX_YAML_CHARS:
        raise ManifestError(
            f"{source}: {len(text):,} characters, more than a kvgraft YAML file may have ({MAX_YAML_CHARS:,})",
            "is this the right file?",
        )
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except RecursionError:
        raise ManifestError(f"{source}: YAML nested too deeply", "a kvgraft file nests a few levels") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        context = ""
        if e.context and e.context_mark and mark and e.context_mark.line != mark.line:
            context = f" ({e.context} started on line {e.context_mark.line + 1})"
        raise ManifestError(
            f"{where}: malformed YAML: {clip(e.problem or e)}{context}", "fix the YAML syntax at that line"
        ) from None
    except yaml.YAMLError as e:
        raise ManifestError(f"{source}: malformed YAML: {clip(str(e))}") from None


def load_manifest(path: str | Path | None = None) -> Manifest:
    """Read and validate a manifest; ``None`` gives the embedded default. Raises ManifestError listing all problems."""
    if path is None:
        raw = (data_dir() / DEFAULT_MANIFEST).read_bytes()
        source, base = BUILTIN_PREFIX + DEFAULT_MANIFEST, data_dir()
    else:
        p = Path(path)
        if p.is_dir():
            raise ManifestError(f"{p} is a directory, expected a manifest YAML file")
        if not p.is_file():
            raise ManifestError(
                f"manifest not found: {p}", "pass an existing YAML file, or omit --manifest for the default"
            )
        if p.stat().st_size > 4 * MAX_YAML_CHARS:  # refused by parse_text anyway; not read into memory first
            raise ManifestError(
                f"{p}: {p.stat().st_size:,} bytes, more than a kvgraft YAML file may have", "is this the right file?"
            )
        raw, source, base = p.read_bytes(), str(p), p.resolve().parent
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{source}: not UTF-8 text ({e})") from None
    data = parse_text(text, source)
    problems = validate_data(data, source, text)
    if problems:
        n = len(problems)
        raise ManifestError(
            f"{source}: {n} problem{'s' if n > 1 else ''}: " + "; ".join(problems[:3]) + (" ..." if n > 3 else ""),
            "run `kvgraft manifest validate` to list every problem",
            problems,
        )
    return Manifest(data=data, source=source, file_sha256=sha256_bytes(raw), base_dir=base)


def with_overrides(m: Manifest, overrides: dict[str, Any]) -> Manifest:
    """A copy of the manifest with dotted-path values replaced (CLI flags), re-validated."""
    if not overrides:
        return m
    data = copy.deepcopy(m.data)
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    problems = validate_data(data, m.source + " (with command-line overrides)")
    if problems:
        raise ManifestError(
            "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else ""), "check the command-line options", problems
        )
    return Manifest(data=data, source=m.source, file_sha256=m.file_sha256, base_dir=m.base_dir)


class _Dumper(yaml.SafeDumper):
    """Writes strings with newlines double-quoted on one line (templates stay readable and exact)."""


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style='"' if "\n" in s else None)
)


def dump_yaml(data: dict[str, Any]) -> str:
    """YAML text of a manifest, keys in schema order, block style."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120)


# A chat model's defaults (`manifest init` on a tokenizer with a chat template). A library entry is the exchange
# (user: problem, assistant: solution, ending in a "Final answer:" line); a miss or a related hit asks the problem
# and lets the model reason (max_new_tokens); an exact hit asks for the final answer only, after "Final answer:",
# under answer_tokens. Chosen on SmolLM2-135M-Instruct and MATH-500 (README, "The real model"): its copy of a
# stored answer is most reliable when the question is short and names the line to repeat.
CHAT_PROMPT = {
    "add_bos": False,  # the chat template writes every special token itself
    "format": "chat",
    "system": None,
    "user": "{problem}",
    "assistant": "{solution}\n\nFinal answer: {answer}",
    "query": "{query}",
    "query_exact": "Repeat the final answer of your solution above, exactly as written.",
    "answer_prefix": "Final answer:",
}
CHAT_DECODE = {"max_new_tokens": 512, "answer_tokens": 32}
# Where a written manifest's runs keep their store and ledger (relative to the folder they run in).
DEFAULT_PATHS = {"store": "kvgraft-store", "ledger": "kvgraft-ledger.jsonl"}


def make_manifest(
    model_path: str,
    model_sha256: str,
    tokenizer_sha256: str,
    *,
    profile: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    attn_implementation: str = "eager",
    threads: int | None = None,
    gpu_name: str | None = None,
    name: str | None = None,
    sdpa_backend: str | None = None,
    schedule: str = "single",
    identity: str = "sha256-tree",
    gguf_sha256: str | None = None,
    chat: bool = False,
    weights_sha256: str | None = None,
    kv_dtype: str | None = None,
) -> dict[str, Any]:
    """A complete pinned manifest for a model directory, with this environment's library versions.

    ``profile`` names a kernel-flag profile (see profiles.PROFILES); ``schedule`` the prefill schedule (single or
    invariant; chunked needs a chunk size: edit the file); ``identity`` how deposited artifacts are named (sha256-tree:
    verified on every core; blake3: what b3sum prints, less CPU than the tree's; sha256: one SHA-256 stream, what
    every manifest without the key means). ``gguf_sha256``
    pins the GGUF a model was dequantized from; ``weights_sha256`` its 4-bit form (``model.weights: q4``); ``kv_dtype``
    a 16-bit cache (``model.kv_dtype``; None: the model's dtype). ``chat`` (a tokenizer with a chat template) writes the chat prompts
    (CHAT_PROMPT) and a reasoning budget (CHAT_DECODE), so that a first `solve` works unedited. Every bit-affecting environment variable
    the profile does not set is pinned to null (must be unset), so a stray one in the shell shows up as drift.
    """
    from importlib.metadata import version

    from .profiles import PROFILES, default_profile, profile_env

    profile = profile or default_profile(device)
    if profile not in PROFILES:
        raise ManifestError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    prof = PROFILES[profile]
    env = profile_env(profile, device)
    n_threads = threads or prof["threads"] or _default_threads()
    data = {
        "kvgraft_manifest": 1,
        "name": name or f"{Path(model_path.removeprefix(BUILTIN_PREFIX)).name}-{profile}-{device}",
        "model": {
            "path": model_path,
            **({"gguf_sha256": gguf_sha256} if gguf_sha256 else {}),
            "sha256": model_sha256,
            "tokenizer_sha256": tokenizer_sha256,
            "dtype": dtype,
            "attn_implementation": attn_implementation,
            **({"weights": "q4", "weights_sha256": weights_sha256} if weights_sha256 else {}),
            **({"kv_dtype": kv_dtype} if kv_dtype else {}),
            # The avx2 profile's bits are every AVX2 machine's only where no MKL product remains: attention's are
            # ATen's under grouped (engine.attention.PRODUCTS)
            **({"attn_products": "aten"} if profile == "avx2" and attn_implementation == "grouped" else {}),
        },
        "runtime": {
            "device": device,
            "gpu_name": gpu_name,
            "cpu_name": None,
            "seed": 0,
            "threads": n_threads,
            "deterministic_algorithms": True,
            "allow_tf32": False,
            "sdpa_backend": (sdpa_backend or "math") if attn_implementation == "sdpa" else None,
            "env": env,
            "versions": {"torch": torch_version(), "transformers": version("transformers")},
        },
        "prefill": {"schedule": schedule, "chunk_size": None},
        "prompt": dict(CHAT_PROMPT)
        if chat
        else {
            "add_bos": True,
            "prefix": "Problem: {problem}\nSolution: {solution}\n",
            "query": "\nQuestion: {query}\nAnswer:",
        },
        "input": {
            "id": "id",
            "problem": "problem",
            "solution": "solution",
            "answer": "answer",
            "answer_extract": "verbatim",
        },
        "decode": dict(CHAT_DECODE) if chat else {"max_new_tokens": 16},
        "paths": dict(DEFAULT_PATHS),
        "artifact": {"identity": identity},
    }
    problems = validate_data(data, "generated manifest")
    if problems:  # a bug here, not user input
        raise ManifestError("; ".join(problems))
    return data


def manifest_for_model_dir(model_dir: str | Path, output: Path | None, **settings: Any) -> tuple[str, ModelHashes]:
    """The YAML text of a pinned manifest for a local model directory (or ``builtin:NAME``), and its hashes.

    A local path is written relative to the folder of ``output`` (the current folder when printing), so the
    manifest and the model can move together. ``settings`` are :func:`make_manifest`'s keyword arguments.
    """
    import os

    from .modelhash import has_chat_template, hash_model_dir

    if str(model_dir).startswith(BUILTIN_PREFIX):
        model_path, real = str(model_dir), builtin_model_dir(str(model_dir)[len(BUILTIN_PREFIX) :])
    else:
        real = Path(model_dir).resolve()
        base = Path(output).resolve().parent if output else Path.cwd()
        model_path = os.path.relpath(real, base)
    hashes = hash_model_dir(real)
    settings.setdefault("chat", has_chat_template(real))
    data = make_manifest(model_path, hashes.model_sha256, hashes.tokenizer_sha256, **settings)
    return "# kvgraft run-manifest, written by `kvgraft manifest init`\n" + dump_yaml(data), hashes


def torch_version() -> str:
    """torch's full version string (``torch.__version__``, with the local build tag such as ``+cpu`` or ``+cu130``)
    read from its ``version.py`` without importing torch, which must wait until the kernel flags are pinned.
    Package metadata is not enough: PyPI's CUDA wheels record ``2.11.0`` where torch reports ``2.11.0+cu130``."""
    import importlib.util
    import re
    from importlib.metadata import version

    try:
        spec = importlib.util.find_spec("torch")
    except ImportError:  # an import hook that refuses torch: the package metadata still says which is installed
        spec = None
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            f = Path(loc) / "version.py"
            if f.is_file():
                m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read_text(encoding="utf-8"), re.M)
                if m:
                    return m.group(1)
    return version("torch")


def _default_threads() -> int:
    import os

    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
