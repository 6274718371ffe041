"""FastKernel: which calls reuse a compiled kernel and launch it directly, with what arguments, and which go
through Triton. A fake JIT function stands for Triton here (nothing compiles on the CPU); the GPU test
`tests/gpu/test_fused_ops_gpu.py::test_fast_launch_equals_triton_launch` runs the real kernels."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from longserve.kernels.launch import FastKernel


@dataclass
class Param:
    name: str
    is_constexpr: bool


@dataclass
class Compiled:
    """What Triton's launch returns: a kernel with a launcher (`run`) that records its calls."""

    spec: tuple
    function: str = "cufunction"
    packed_metadata: str = "meta"
    runs: list = field(default_factory=list)

    def run(self, *a):
        self.runs.append(a)


class FakeJit:
    """x_ptr, n (runtime), BLOCK (constexpr), like `_kernel[grid](x, n, BLOCK=..., num_warps=...)`."""

    params = [Param("x_ptr", False), Param("n", False), Param("BLOCK", True)]

    def __init__(self) -> None:
        self.compiles: list[tuple] = []  # every launch through "Triton"

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            compiled = Compiled(spec=(grid, args, tuple(kwargs.items())))
            self.compiles.append(compiled.spec)
            return compiled

        return launch


@pytest.fixture()
def kernel():
    k = FastKernel(FakeJit())
    k._current_device = lambda: 0  # no CUDA here
    k._raw_stream = lambda device: 1234
    return k


def test_second_call_of_a_key_launches_the_compiled_kernel_directly(kernel) -> None:
    x = torch.zeros(64)
    kernel[(4,)](x, 64, BLOCK=32, num_warps=4)
    assert kernel.slow_launches == 1 and kernel.fast_launches == 0
    compiled = next(iter(kernel._compiled.values()))
    y = torch.ones(128)
    kernel[(8, 2)](y, 128, BLOCK=32, num_warps=4)  # other values, same specialization
    assert kernel.slow_launches == 1 and kernel.fast_launches == 1
    (run,) = compiled.runs
    assert run[:7] == (8, 2, 1, 1234, "cufunction", "meta", None)
    assert run[7:9] == (None, None)  # no launch hooks
    assert run[9] is y and run[10:] == (128, 32)  # runtime args, then the constexprs in parameter order


@pytest.mark.parametrize(
    "other",
    [
        lambda x: ((x, 1), {"BLOCK": 32, "num_warps": 4}),  # Triton makes n == 1 a constant
        lambda x: ((x, 65), {"BLOCK": 32, "num_warps": 4}),  # not divisible by 16
        lambda x: ((x, 2**40), {"BLOCK": 32, "num_warps": 4}),  # a 64-bit int
        lambda x: ((x[1:], 64), {"BLOCK": 32, "num_warps": 4}),  # a pointer not 16-byte aligned
        lambda x: ((x.half(), 64), {"BLOCK": 32, "num_warps": 4}),  # another dtype
        lambda x: ((x, 64), {"BLOCK": 64, "num_warps": 4}),  # another constexpr
        lambda x: ((x, 64), {"BLOCK": 32, "num_warps": 8}),  # another launch option
    ],
    ids=["int-1", "int-unaligned", "int64", "ptr-unaligned", "dtype", "constexpr", "num_warps"],
)
def test_a_call_triton_would_specialize_differently_compiles_again(kernel, other) -> None:
    x = torch.zeros(64)
    kernel[(4,)](x, 64, BLOCK=32, num_warps=4)
    args, kwargs = other(x)
    kernel[(4,)](*args, **kwargs)
    assert kernel.slow_launches == 2 and kernel.fast_launches == 0
    kernel[(4,)](*args, **kwargs)  # and that variant is kept too
    assert kernel.fast_launches == 1 and len(kernel._compiled) == 2


def test_one_is_its_own_specialization(kernel) -> None:
    x = torch.zeros(64)
    kernel[(4,)](x, 17, BLOCK=32)
    kernel[(4,)](x, 1, BLOCK=32)  # Triton compiles n == 1 as a constant: 17's kernel must not run it
    kernel[(4,)](x, 3, BLOCK=32)  # 17's kernel does
    assert kernel.slow_launches == 2 and kernel.fast_launches == 1


def test_calls_the_key_cannot_describe_always_go_through_triton(kernel) -> None:
    x = torch.zeros(64)
    for _ in range(2):
        kernel[(4,)](x, n=64, BLOCK=32)  # a runtime argument by keyword
        kernel[(4,)](x, 64)  # a constexpr left to its default
        kernel[(4,)](x, "64", BLOCK=32)  # an argument type the key does not know
    assert kernel.slow_launches == 6 and kernel.fast_launches == 0 and not kernel._compiled


def test_installed_launch_hooks_get_triton_s_launch(kernel) -> None:
    knobs = pytest.importorskip("triton").knobs
    x = torch.zeros(64)
    kernel[(4,)](x, 64, BLOCK=32)
    seen = []
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this triton's launch hooks are not chains")
    hook.add(seen.append)
    try:
        kernel[(4,)](x, 64, BLOCK=32)
    finally:
        hook.remove(seen.append)
    assert kernel.slow_launches == 2 and kernel.fast_launches == 0
    kernel[(4,)](x, 64, BLOCK=32)
    assert kernel.fast_launches == 1


def test_kernels_not_compiled_by_triton_are_left_as_they_are() -> None:
    from longserve.kernels.launch import fast_launch

    def interpreted(*a):  # the interpreter's functions are not JITFunctions
        return a

    assert fast_launch(interpreted) is interpreted


def test_a_launcher_that_rejects_direct_arguments_turns_the_fast_path_off(kernel) -> None:
    """Another triton's launcher signature: the first direct launch raises TypeError before launching; that
    call and every later one go through Triton."""
    x = torch.zeros(64)
    kernel[(4,)](x, 64, BLOCK=32)
    compiled = next(iter(kernel._compiled.values()))

    def run(*a):
        raise TypeError("launch() takes 9 positional arguments")

    compiled.run = run
    kernel[(4,)](x, 64, BLOCK=32)
    kernel[(4,)](x, 64, BLOCK=32)
    assert kernel.fast_launches == 0 and kernel.slow_launches == 3 and len(kernel.fn.compiles) == 3
