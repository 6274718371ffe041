# vLLM 0.24's slim build (../shared/anchors/, copied into .anchor/ and carried: its README) unpacked into /tmp/site,
# and cuDNN's frontend wheel carried beside it (fetch_test_wheels.sh puts it there) installed into the folder named:
# without it longserve's prefix hit runs without its packed graphs. Sourced by gpu_check.sh (unpack_vllm: a folder of
# its own, which longserve's runs see without vLLM's packages) and compare_vllm_http.sh (/tmp/site: its longserve
# server takes fastapi and the rest from there).
# shellcheck shell=bash
unpack_vllm_anchor() {  # FRONTEND_TARGET; fails when vLLM's build or the anchor's scripts are missing
  local f
  for f in bench_vllm.py vllm_decode.py vllm-0.24.0-h200-site.tar.xz; do  # (forty-second session: a call ran
    # longserve's half, then found no bench_vllm.py: copy all of ../shared/anchors/ into .anchor/)
    [[ -f .anchor/$f ]] || { echo "unpack_vllm_anchor: .anchor/$f missing: cp ../shared/anchors/* .anchor/" >&2; return 1; }
  done
  mkdir -p /tmp/site && python3 -c "import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site', filter='tar')" \
    < .anchor/vllm-0.24.0-h200-site.tar.xz || return 1
  if ls .anchor/nvidia_cudnn_frontend-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" \
      .anchor/nvidia_cudnn_frontend-*.whl || echo "unpack_vllm_anchor: cuDNN's frontend did not install into $1"
  else
    echo "unpack_vllm_anchor: no cuDNN frontend wheel in .anchor/: longserve runs without its packed prefix-hit graphs"
  fi
}
