#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on a GPU machine without network into .whl/ (run here, where
# pip reaches a registry). The CUDA image brings torch, numpy, pyyaml, filelock, tokenizers, safetensors and
# huggingface-hub; these are what it lacked on the H200 image (2026-11), for its Python 3.12 on x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  transformers==5.24.0 zstandard==0.25.0 rfc8785==0.1.4 fastjsonschema==2.22.3 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 typer==0.29.2 rich==15.0.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
ls .whl
