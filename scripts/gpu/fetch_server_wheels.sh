#!/usr/bin/env bash
# Wheels of the server's packages for a GPU machine without a package index (Python 3.12, x86-64): into .whl/
# (ignored by git). Copy .whl/ there with the tree and install them before serving:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit;
# (then e.g. `bash scripts/gpu/serve_turns.sh`). The versions are the ones installed here, which CI tests with.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
pkgs=()
for name in fastapi starlette pydantic pydantic-core uvicorn h11 annotated-types annotated-doc typing-inspection \
    anyio sniffio click idna opentelemetry-api importlib-metadata zipp typing-extensions; do
  version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
  if [[ -n $version ]]; then pkgs+=("$name==$version"); fi
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pkgs[@]}"
ls -la .whl && du -sh .whl
