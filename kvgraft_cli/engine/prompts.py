"""The texts a run computes: a library entry's prefix, a chain link, the question; plain templates or a chat model's.

A manifest's ``prompt.format`` is ``text`` (the default: ``prefix`` and ``query`` are str.format templates) or
``chat``: every text is rendered with the tokenizer's own chat template, which the manifest pins through
``model.tokenizer_sha256``. Under ``chat`` a library entry is a completed exchange (user turn, assistant turn), a
chain is successive exchanges and the question is a user turn followed by the generation prompt.

A graft computes the context piece by piece: the root entry, each link on the cache before it, then the question.
That is exact only if the pieces' tokens, joined, are the tokens of the whole conversation rendered at once, which
is what a fresh run computes. A template that renders a turn differently once later turns follow (some strip the
reasoning out of earlier assistant turns, or number the turns) cannot be grafted: :meth:`Prompts.link_text`
refuses it when the rendering of a conversation is not a prefix of the rendering of the conversation continued, and
:meth:`Prompts.check_conversation` compares the token ids of every solve's whole conversation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..config.manifest import clip
from ..errors import UnsupportedModel

if TYPE_CHECKING:
    from ..config.sections import PromptSection

# A stand-in exchange: the text of a turn that follows another is the whole rendering minus the rendering before it.
# Its assistant turn has reasoning markup, which templates of reasoning models strip from turns that later ones
# follow; any other difference in real content is caught by Prompts.check_conversation on every solve.
_EARLIER = (
    {"role": "user", "content": "an earlier problem"},
    {"role": "assistant", "content": "<think>\nan earlier thought\n</think>\n\nan earlier solution"},
)


class Prompts:
    """The manifest's prompt settings bound to a tokenizer (the chat template comes from the tokenizer)."""

    def __init__(self, prompt: PromptSection, tokenizer: Any, model_name: str = "the model"):
        self.prompt = prompt
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat = prompt.chat
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise UnsupportedModel(
                f"prompt.format is chat, but {model_name}'s tokenizer has no chat template",
                "use prompt.format: text, or a model whose tokenizer ships a chat template",
            )
        self._before: str | None = None

    # -- chat rendering -----------------------------------------------------------------------------------------
    def _system(self) -> list[dict[str, str]]:
        system = self.prompt.system
        return [{"role": "system", "content": system}] if system is not None else []

    def render(self, messages: list[dict[str, str]], generation: bool = False) -> str:
        """The tokenizer's chat template applied to ``messages`` (with the generation prompt when asked)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        if not isinstance(text, str):  # a template must render text; anything else is not one kvgraft can pin
            raise UnsupportedModel(f"{self.model_name}'s chat template rendered {type(text).__name__}, not text")
        return text

    def _continued(self, turns: list[dict[str, str]], generation: bool) -> str:
        """The text ``turns`` add after an earlier exchange: refuses a template that re-renders earlier turns."""
        if self._before is None:
            self._before = self.render(self._system() + list(_EARLIER))
        whole = self.render(self._system() + list(_EARLIER) + turns, generation)
        if not whole.startswith(self._before):
            raise UnsupportedModel(
                f"{self.model_name}'s chat template re-renders earlier turns once later ones follow (the "
                f"conversation so far, {clip(repr(self._before[-60:]), 80)}, is not a prefix of the conversation "
                "continued): a graft of earlier turns cannot equal a fresh run",
                "use prompt.format: text, or a chat template that renders each turn on its own",
            )
        return whole[len(self._before) :]

    @staticmethod
    def _fill(template: str | None, fields: dict[str, str]) -> str:
        assert template is not None  # (validation requires the templates of the manifest's prompt.format)
        return template.format(**fields)

    def _exchange(self, fields: dict[str, str]) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": self._fill(self.prompt.user, fields)},
            {"role": "assistant", "content": self._fill(self.prompt.assistant, fields)},
        ]

    # -- the texts ----------------------------------------------------------------------------------------------
    def root_text(self, fields: dict[str, str]) -> str:
        """A library entry deposited on its own (a chain's root): text mode's prefix; chat: the first exchange."""
        if not self.chat:
            return self._fill(self.prompt.prefix, fields)
        return self.render(self._system() + self._exchange(fields))

    def link_text(self, fields: dict[str, str]) -> str:
        """A library entry after others (a chain link): text mode's prefix; chat: the exchange as a later turn."""
        if not self.chat:
            return self._fill(self.prompt.prefix, fields)
        return self._continued(self._exchange(fields), False)

    def question_template(self, exact: bool) -> str:
        """The question's template: ``query_exact`` on an exact hit when the manifest has one, else ``query``."""
        return (self.prompt.query_exact or self.prompt.query) if exact else self.prompt.query

    def answer_prefix(self, exact: bool) -> str:
        """What the answer starts with (part of the prompt and of the output): on an exact hit, ``answer_prefix``."""
        return (self.prompt.answer_prefix or "") if exact else ""

    def question_text(self, query: str, *, exact: bool = False, first: bool = False) -> str:
        """The question after the context (``first``: nothing before it). Text mode: the template (BOS is the
        caller's, as for every prefix); chat: a user turn, the generation prompt and the answer prefix."""
        content = self.question_template(exact).format(query=query)
        if not self.chat:
            return content + self.answer_prefix(exact)
        turn = [{"role": "user", "content": content}]
        head = self.render(self._system() + turn, True) if first else self._continued(turn, True)
        return head + self.answer_prefix(exact)

    def conversation_text(self, entries: Iterable[dict[str, str]], query: str, exact: bool) -> str:
        """Chat: the whole conversation rendered at once, what a fresh run computes: every entry's exchange, the
        question's user turn, the generation prompt and the answer prefix."""
        messages = self._system()
        for fields in entries:
            messages += self._exchange(fields)
        messages.append({"role": "user", "content": self.question_template(exact).format(query=query)})
        return self.render(messages, True) + self.answer_prefix(exact)

    def check_conversation(self, grafted: list[int], question: list[int], whole: list[int]) -> None:
        """Refuse when the grafted tokens followed by the question's are not the whole conversation's tokens."""
        if grafted + question != whole:
            at = next(
                (i for i, (a, b) in enumerate(zip(grafted + question, whole)) if a != b),
                min(len(grafted) + len(question), len(whole)),
            )
            raise UnsupportedModel(
                f"{self.model_name}'s chat template: the grafted library ({len(grafted)} tokens) and the question "
                f"({len(question)}) are not the tokens of the whole conversation rendered at once ({len(whole)}); "
                f"they differ from token {at}",
                "the template or tokenizer renders a turn differently in context: "
                "use prompt.format: text for this model",
            )
