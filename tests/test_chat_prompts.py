"""Chat prompts (engine.prompts): the pieces a graft computes equal the whole conversation, and a chat template that
re-renders earlier turns is refused by name. A tokenizer of the embedded tiny model with chat templates set here
(fast, no model weights); tests/test_gguf.py checks the same with the real SmolLM2 tokenizer and model."""

from __future__ import annotations

import copy

import pytest

from kvgraft_cli.config.manifest import CHAT_PROMPT, compute_pin, load_manifest, validate_data
from kvgraft_cli.config.sections import PromptSection
from kvgraft_cli.engine.prompts import Prompts
from kvgraft_cli.errors import UnsupportedModel

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Like reasoning models' templates: an assistant turn followed by later turns loses its reasoning.
STRIPS_EARLIER = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<a>' + m['content'].split('</think>')[-1] + '</a>' }}{% else %}"
    "{{ '<' + m['role'][0] + '>' + m['content'] + '</' + m['role'][0] + '>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<a>' }}{% endif %}"
)


@pytest.fixture
def tokenizer():
    from kvgraft_cli.engine.tinymodel import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = CHATML
    return tok


ENTRIES = [
    {"id": str(i), "problem": f"What is {i}+{i}? {{braces}} stay", "solution": f"It is {2 * i}.", "answer": str(2 * i)}
    for i in range(1, 4)
]


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_pieces_join_to_the_whole_conversation(tokenizer):
    p = Prompts(PromptSection.from_dict(CHAT_PROMPT), tokenizer)
    for n in (1, 2, 3):
        grafted = _ids(tokenizer, p.root_text(ENTRIES[0])) + [
            t for e in ENTRIES[1:n] for t in _ids(tokenizer, p.link_text(e))
        ]
        for exact in (False, True):
            q = _ids(tokenizer, p.question_text("What is 9+9?", exact=exact))
            whole = _ids(tokenizer, p.conversation_text(ENTRIES[:n], "What is 9+9?", exact))
            assert grafted + q == whole
    assert p.root_text(ENTRIES[0]).startswith("<|im_start|>system\n")  # the template's default system turn, once
    assert "system" not in p.link_text(ENTRIES[1]) and "system" not in p.question_text("q")
    assert p.question_text("q", first=True).startswith("<|im_start|>system\n")
    assert p.question_text("q", exact=True).endswith("<|im_start|>assistant\nFinal answer:")


def test_a_system_turn_is_rendered_once(tokenizer):
    p = Prompts(PromptSection.from_dict({**CHAT_PROMPT, "system": "Be brief."}), tokenizer)
    assert p.root_text(ENTRIES[0]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert "Be brief." not in p.link_text(ENTRIES[1])


def test_refuses_a_template_that_rerenders_earlier_turns(tokenizer):
    tokenizer.chat_template = STRIPS_EARLIER
    p = Prompts(PromptSection.from_dict(CHAT_PROMPT), tokenizer, "strip-model")
    p.root_text(ENTRIES[0])  # a single exchange renders
    with pytest.raises(UnsupportedModel, match="strip-model's chat template re-renders earlier turns"):
        p.link_text(ENTRIES[1])
    with pytest.raises(UnsupportedModel, match="re-renders earlier turns"):
        p.question_text("q")


def test_check_conversation_names_the_first_difference(tokenizer):
    p = Prompts(PromptSection.from_dict(CHAT_PROMPT), tokenizer, "m")
    p.check_conversation([1, 2], [3], [1, 2, 3])
    with pytest.raises(UnsupportedModel, match="differ from token 1"):
        p.check_conversation([1, 5], [3], [1, 2, 3])


def test_chat_format_needs_a_tokenizer_template(tokenizer):
    tokenizer.chat_template = None
    with pytest.raises(UnsupportedModel, match="no chat template"):
        Prompts(PromptSection.from_dict(CHAT_PROMPT), tokenizer, "plain")


def test_manifest_chat_fields_are_validated():
    data = copy.deepcopy(load_manifest(None).data)
    data["prompt"] = dict(CHAT_PROMPT)
    assert validate_data(data, "m") == []
    bad = copy.deepcopy(data)
    del bad["prompt"]["assistant"]
    bad["prompt"]["prefix"] = "x"
    problems = " ".join(validate_data(bad, "m"))
    assert "prompt.assistant: required for prompt.format chat" in problems
    assert "prompt.prefix: not used by prompt.format chat" in problems
    bad = copy.deepcopy(data)
    bad["prompt"]["query_exact"] = "{nope}"
    assert "unknown placeholder" in " ".join(validate_data(bad, "m"))


def test_text_manifests_pin_what_they_pinned():
    """The compute pin of a text-format manifest is unchanged by the chat format's keys (deposited artifacts of every
    earlier manifest still graft); the question's templates decide no cache bit, the turns' templates do."""
    m = load_manifest(None)
    assert compute_pin(m.data)["prompt"] == {
        "add_bos": m.data["prompt"]["add_bos"],
        "prefix": m.data["prompt"]["prefix"],
    }
    chat = copy.deepcopy(m.data)
    chat["prompt"] = dict(CHAT_PROMPT)
    other = copy.deepcopy(chat)
    other["prompt"]["query_exact"] = "Just the answer."
    assert compute_pin(chat) == compute_pin(other)
    other["prompt"]["assistant"] = "{solution}"
    assert compute_pin(chat) != compute_pin(other)


# Renders an assistant turn differently once later turns follow, but only when its text has "Final" in it: the
# stand-in exchange passes, real library entries do not, so only the whole-conversation check of solve finds it.
RENAMES_IN_CONTEXT = CHATML.replace(
    "message['content'] + '<|im_end|>'",
    "(message['content'].replace('Final', 'FINAL') if message['role'] == 'assistant' and not loop.last "
    "else message['content']) + '<|im_end|>'",
)


def _chat_engine(engine, template: str):
    import dataclasses

    from kvgraft_cli.config.manifest import Manifest

    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = template
    data = copy.deepcopy(engine.manifest.data)
    data["prompt"] = dict(CHAT_PROMPT)
    data["decode"] = {"max_new_tokens": 4, "answer_tokens": 2}
    m = Manifest(data=data, source="chat-test", file_sha256="0" * 64, base_dir=engine.manifest.base_dir)
    return dataclasses.replace(engine, manifest=m, tokenizer=tok)


def test_solve_checks_the_whole_conversation(tmp_path, engine):
    """solve grafts the library's exchanges and asks the question; with a template that renders an earlier turn
    differently, the grafted tokens are not the whole conversation's, and solve refuses before decoding (red if
    solve skips Prompts.check_conversation). With the plain ChatML template the same run answers."""
    from conftest import EXAMPLES

    from kvgraft_cli.library.solve import solve
    from kvgraft_cli.runs.context import RunContext
    from kvgraft_cli.runs.deposit import deposit

    problems = tmp_path / "p.jsonl"
    problems.write_text("".join(EXAMPLES.read_text().splitlines(keepends=True)[:2]))
    for name, template in (("ok", CHATML), ("bad", RENAMES_IN_CONTEXT)):
        eng = _chat_engine(engine, template)
        ctx = RunContext.make(eng.manifest, tmp_path / name / "store", tmp_path / name / "ledger.jsonl")
        deposit(ctx, problems, engine=eng)
        if name == "ok":
            run = solve(ctx, problems, tmp_path / name / "out.jsonl", engine=eng)
            assert [r.hit for r in run.records] == ["exact", "exact"]
            assert all(r.output.startswith("Final answer:") for r in run.records)
        else:
            with pytest.raises(UnsupportedModel, match="not the tokens of the whole conversation"):
                solve(ctx, problems, tmp_path / name / "out.jsonl", engine=eng)
