"""Test-wide setup. Without a GPU, Triton kernels run only in Triton's interpreter, and triton must see
TRITON_INTERPRET=1 before it is first imported: a module that imports triton while being collected (e.g.
longserve.kernels.launch reads `triton.knobs`) would otherwise leave every later interpreted kernel failing
("Cannot call @triton.jit'd outside of the scope of a kernel"), depending on the order files are collected."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist (the README's `-n 2`): in a worker the machine's cores are split between the workers, as torch's
# intra-op threads (one a core by default in each) would otherwise oversubscribe them.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    )


# The sm90 compile check (longserve/testing/kernel_compile.py): in CI (CI=true) or with
# LONGSERVE_COMPILE_KERNELS=1, every Triton kernel variant the interpreted tests launched (those covering every
# constexpr switch: ~90, ~40 s) is compiled for sm90 with the real compiler at the end of the session, as the GPU
# launches it (its interpreter-only switches off), and a variant that does not compile, or whose PTX holds a 16-bit
# FMA (a rounding its source asks for, fused away), fails the run: the interpreter accepts programs the compiler
# refuses, and rounds as written.
# LONGSERVE_RECORD_KERNELS=FILE appends the recorded variants to FILE instead.
_COMPILE_CHECK = (
    os.environ.get("LONGSERVE_COMPILE_KERNELS", "1" if os.environ.get("CI") == "true" else "0") == "1"
)
_RECORD_FILE = os.environ.get("LONGSERVE_RECORD_KERNELS")
# Under xdist the workers run the kernels and append their records to this file, named by the controller (its
# environment is theirs), which compiles them once all have finished.
_WORKER_RECORDS = "LONGSERVE_WORKER_KERNEL_RECORDS"


# Bounds checks (longserve/testing/memcheck.py): in CI or with LONGSERVE_MEMCHECK=1, every interpreted kernel's
# loads and stores must stay inside its tensor arguments, which the interpreter itself never checks.
_MEMCHECK = os.environ.get("LONGSERVE_MEMCHECK", "1" if os.environ.get("CI") == "true" else "0") == "1"
_memcheck = None


def pytest_configure(config) -> None:
    global _memcheck
    if _MEMCHECK and os.environ.get("TRITON_INTERPRET") == "1" and _memcheck is None:
        from longserve.testing.memcheck import bounds_checked

        _memcheck = bounds_checked()
        _memcheck.__enter__()
    if not ((_COMPILE_CHECK or _RECORD_FILE) and os.environ.get("TRITON_INTERPRET") == "1"):
        return
    if _WORKER is None and getattr(config.option, "numprocesses", None):  # xdist's controller: runs no test
        if not _COMPILE_CHECK:  # the workers append to LONGSERVE_RECORD_KERNELS alone
            return
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            os.environ[_WORKER_RECORDS] = f.name
        return
    from longserve.testing.kernel_compile import record_launches

    record_launches()


def pytest_sessionfinish(session, exitstatus) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" or not (_COMPILE_CHECK or _RECORD_FILE):
        return
    from longserve.testing.kernel_compile import dump_records

    if _RECORD_FILE:
        dump_records(_RECORD_FILE)
    if _WORKER is not None:  # the controller compiles what every worker recorded
        if _COMPILE_CHECK and _WORKER_RECORDS in os.environ:
            dump_records(os.environ[_WORKER_RECORDS])
        return
    path = os.environ.pop(_WORKER_RECORDS, None)  # the workers' file under xdist, deleted once compiled
    try:
        if not _COMPILE_CHECK or exitstatus != 0:
            return
        from longserve.testing.kernel_compile import sm90_compiler_missing

        missing = sm90_compiler_missing()
        if missing:  # a triton build without the nvidia backend (e.g. a CPU-only one): nothing to check with
            print(f"\nsm90 compile check skipped: {missing}")
            return
        if path is None:  # one process: its own records, through a file of its own
            import tempfile

            with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
                path = f.name
            dump_records(path)
        if os.path.getsize(path) > 0:
            _compile_records(session, path)
    finally:
        if path is not None and os.path.exists(path):
            os.remove(path)


def _compile_records(session, path: str) -> None:
    import json
    import subprocess
    import sys
    import time

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    # as many compiles at once as cores (the suite's workers are done by now)
    jobs = str(min(4, os.cpu_count() or 1))
    cmd = [
        sys.executable,
        "-m",
        "longserve.testing.kernel_compile",
        path,
        "--package",
        "longserve.",
        "--jobs",
        jobs,
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    failed = [line for line in lines if '"ok": false' in line]
    results = [json.loads(line) for line in lines]
    tiles = [
        r for r in results if r.get("tile")
    ]  # testing/gpu_tiles.py: attention and fused MoE at the GPU's tiles
    print(
        f"\nsm90 compile check: {len(results) - len(failed)} of {len(results)} kernel variants compiled: "
        f"{len(results) - len(tiles)} recorded, {len(tiles)} at the GPU's tiles (attention, fused MoE) "
        f"({time.perf_counter() - start:.0f} s)"
    )
    for line in failed:
        print("  FAILED " + line)
    # spills in the build the GPU runs (specialized as the JIT does): not a failure, a lead for the next GPU call
    for r in results:
        if r.get("local"):
            tile = f" at {r['tile']}" if r.get("tile") else ""
            print(f"  spills: {r['kernel']}{tile} {r['local']} bytes of local memory, {r['regs']} registers")
    if done.returncode != 0:
        if not failed:
            print(done.stderr[-3000:])
        session.exitstatus = 1
