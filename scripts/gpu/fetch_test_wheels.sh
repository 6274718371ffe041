#!/usr/bin/env bash
# Wheels the GPU tests need beyond the GPU machine's image (Python 3.12, x86-64), into .whl/ (git-ignored):
# xgrammar and jsonschema (structured output), compressed-tensors and AutoAWQ (the quantized checkpoints'
# own writers) and what they import, and cuDNN's frontend (a probe's). Carry .whl/ and install before
# `gpu_check.sh tests|quant|...`:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit;
# About 17 MB. AutoAWQ 0.2.9 ships no wheel: it is built here (pure Python). The versions are the ones
# installed here, which CI tests with.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
pkgs=()
for name in xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection jsonschema \
    jsonschema-specifications referencing rpds-py compressed-tensors loguru datasets dill multiprocess zstandard; do
  version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
  if [[ -n $version ]]; then pkgs+=("$name==$version"); fi
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pkgs[@]}"
# cuDNN's graph API for scripts/probes/probe_paged_cudnn.py (not installed here: it loads the cuDNN torch brings on
# the GPU machine); 1.14.1 is the binding alone (later ones pull in the CUTLASS DSL)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl nvidia-cudnn-frontend==1.14.1
# and beside vLLM's slim build in .anchor/, which the vLLM modes carry alone (with .whl/ past the 64 MiB that
# travel): longserve's packed prefix-hit graphs need the frontend (attention/packed_graph.py; gpu_check.sh's
# unpack_vllm and compare_vllm_http.sh install it)
# .anchor/ itself from ../shared/anchors/ where it lies (all of it: the modes refuse to start without its scripts)
if [[ -d ../shared/anchors ]]; then mkdir -p .anchor && cp ../shared/anchors/*.py ../shared/anchors/*.tar.xz .anchor/; fi
if [[ -d .anchor ]]; then cp .whl/nvidia_cudnn_frontend-1.14.1-*.whl .whl/compressed_tensors-*.whl .whl/loguru-*.whl .anchor/; fi
awq=$(python3 -m pip show autoawq 2>/dev/null | sed -n 's/^Version: //p' || true)
if [[ -n $awq ]]; then python3 -m pip wheel -q --no-deps --no-build-isolation "autoawq==$awq" -w .whl; fi
ls -la .whl && du -sh .whl
