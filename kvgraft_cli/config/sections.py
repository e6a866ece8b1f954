"""A manifest's sections as frozen, typed values, made once from the validated document.

Code outside ``config/`` reads a manifest through these (``manifest.model.dtype``, ``manifest.prefill.schedule``),
never through its dictionary: a key's default (``weights: dequantized``, ``format: text``) is said here once, and a
misspelt field is an AttributeError where it is written rather than a KeyError on the day a run reaches it.

A section also keeps the mapping it was made from (:meth:`Section.as_written`): what the ledger records of it
(``input`` as a deposit's mapping, the question prompts a solve names) is the manifest's own text, key for key,
so ledgers written before the sections existed keep their canonical bytes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

S = TypeVar("S", bound="Section")


@dataclass(frozen=True)
class Section:
    """Base of a manifest section: ``from_dict`` reads a validated mapping (absent keys take the field's default)."""

    _written: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False, kw_only=True)
    name: ClassVar[str] = ""

    @classmethod
    def from_dict(cls: type[S], data: Mapping[str, Any]) -> S:
        """The section of a validated manifest's mapping (the schema decided its keys and types)."""
        names = {f.name for f in fields(cls) if f.name != "_written"}
        values = {k: _frozen(v) for k, v in data.items() if k in names}
        return cls(**values, _written=MappingProxyType(copy.deepcopy(dict(data))))

    def as_written(self) -> dict[str, Any]:
        """The section as the manifest wrote it (a copy): absent keys absent, for records whose bytes are pinned."""
        return copy.deepcopy(dict(self._written))

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes`` written over the manifest's keys (not validated: for code that derives a
        section, such as a test's variant)."""
        return type(self).from_dict({**self.as_written(), **changes})

    def has(self, key: str) -> bool:
        """Whether the manifest wrote ``key`` in this section (some records name only what it wrote)."""
        return key in self._written


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class ModelSection(Section):
    """Which model, pinned by hash, and how it computes (``model``)."""

    path: str
    sha256: str
    tokenizer_sha256: str
    dtype: str
    attn_implementation: str
    gguf_sha256: str | None = None
    weights: str = "dequantized"
    weights_sha256: str | None = None
    attn_products: str = "blas"
    kv_dtype: str | None = None
    name: ClassVar[str] = "model"


@dataclass(frozen=True)
class RuntimeSection(Section):
    """Where and under which pins it computes (``runtime``): device, threads, seed, environment, versions."""

    device: str
    gpu_name: str | None
    seed: int
    threads: int
    deterministic_algorithms: bool
    allow_tf32: bool
    env: Mapping[str, str | None]
    versions: Mapping[str, str]
    cpu_name: str | None = None
    sdpa_backend: str | None = None
    name: ClassVar[str] = "runtime"


@dataclass(frozen=True)
class PrefillSection(Section):
    """How a prefix is computed (``prefill``): one forward, chunks, or a forward per token (invariant)."""

    schedule: str
    chunk_size: int | None = None
    cut_before: tuple[str, ...] = ()
    name: ClassVar[str] = "prefill"

    @property
    def invariant(self) -> bool:
        """Every token in a forward of its own: the bits do not depend on how calls group tokens."""
        return self.schedule == "invariant"


@dataclass(frozen=True)
class PromptSection(Section):
    """The templates of a deposited prefix and of a question (``prompt``)."""

    add_bos: bool
    query: str
    format: str = "text"
    prefix: str | None = None
    system: str | None = None
    user: str | None = None
    assistant: str | None = None
    query_exact: str | None = None
    answer_prefix: str | None = None
    name: ClassVar[str] = "prompt"

    @property
    def chat(self) -> bool:
        """Rendered by the tokenizer's chat template (format chat) rather than as plain text."""
        return self.format == "chat"

    def with_bos(self, ids: list[int], bos: int | None) -> list[int]:
        """``ids`` with the tokenizer's BOS in front where ``add_bos`` asks for it and the tokenizer has one: the one
        rule for every prefix and question the engine and the server tokenize."""
        return [bos] + ids if self.add_bos and bos is not None else ids


@dataclass(frozen=True)
class InputSection(Section):
    """Which fields of a problems file hold what (``input``); recorded whole as a run's mapping."""

    id: str | None
    problem: str
    solution: str
    answer: str | None
    answer_extract: str
    name: ClassVar[str] = "input"


@dataclass(frozen=True)
class DecodeSection(Section):
    """Generation budgets (``decode``): ``answer_tokens`` is an exact hit's (default: ``max_new_tokens``)."""

    max_new_tokens: int
    answer_tokens: int | None = None
    stop: tuple[str, ...] = ()
    name: ClassVar[str] = "decode"

    def budget(self, exact: bool) -> int:
        """The decode budget of a question: ``answer_tokens`` on an exact hit (the answer only), else
        ``max_new_tokens``."""
        return (self.answer_tokens or self.max_new_tokens) if exact else self.max_new_tokens


@dataclass(frozen=True)
class PathsSection(Section):
    """Where runs keep their store and ledger (``paths``), relative to the folder they run in."""

    store: str
    ledger: str
    name: ClassVar[str] = "paths"


@dataclass(frozen=True)
class ArtifactSection(Section):
    """How deposited artifacts are named (``artifact.identity``; absent: one SHA-256 stream)."""

    identity: str = "sha256"
    name: ClassVar[str] = "artifact"


SECTIONS: tuple[type[Section], ...] = (
    ModelSection,
    RuntimeSection,
    PrefillSection,
    PromptSection,
    InputSection,
    DecodeSection,
    PathsSection,
    ArtifactSection,
)
