#!/usr/bin/env bash
# Lint and types, as CI runs them (the README's test command calls this first): ruff's linter and its formatter's
# check over the repository (pyproject.toml [tool.ruff]), then mypy on the package (pyproject.toml [tool.mypy]).
# `ruff format .` and `ruff check --fix .` repair most of what this reports.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check --quiet .
ruff format --check --quiet .
mypy --no-error-summary --hide-error-context
echo "lint: ruff check, ruff format --check and mypy passed"
