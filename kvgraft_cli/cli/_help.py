"""How kvgraft's help reads: arguments as ``PROBLEMS`` and ``[LEDGER]`` (not typer's ``{problems}``), flags without a
``<bool>`` type, and brackets in help text printed as written. Every command is registered with ``cls=Command`` and
every group made with ``cls=Group`` (tests/test_cli_ux.py and tests/test_help_extras.py walk the whole command
tree)."""

from __future__ import annotations

import inspect

import typer.core
from rich.markup import escape


def _tidy(params) -> None:
    for p in params:
        if getattr(p, "metavar", "x") is not None:
            continue
        if getattr(p, "param_type_name", "") == "argument":
            p.metavar = (p.name or "arg").upper()
        elif getattr(p, "is_flag", False) and not getattr(p, "count", False):
            p.metavar = ""  # a flag takes no value: show no type


def _literal(text: str | None) -> str | None:
    """Help text as written: typer renders help through rich, which reads ``[ray]`` in ``pip install 'kvgraft[ray]'``
    as a style tag and drops it. kvgraft's help uses no markup, so every tag-like bracket is escaped."""
    return escape(text) if text else text


def _literal_help(params) -> None:
    for p in params:
        if getattr(p, "help", None):
            p.help = _literal(p.help)


def _unwrap(text: str | None) -> str | None:
    """A docstring's paragraphs as single lines (rich help keeps the source's line breaks mid-sentence)."""
    if not text:
        return text
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n"))


class Command(typer.core.TyperCommand):
    """A typer command whose help names arguments in capitals, shows no type for flags, reflows docstrings and
    prints brackets as written."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.help = _literal(_unwrap(self.help))
        _literal_help(self.params)
        _tidy(self.params)

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            _tidy([opt])
        return opt

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if getattr(p, "param_type_name", "") != "argument":
                continue
            name = p.metavar or (p.name or "arg").upper()
            name = name if p.required else f"[{name}]"
            pieces.append(name + ("..." if p.nargs != 1 else ""))
        return pieces


class Group(typer.core.TyperGroup):
    """A typer group whose ``--help`` flag shows no type and whose help prints brackets as written."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.help = _literal(self.help)
        _literal_help(self.params)

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            _tidy([opt])
        return opt
