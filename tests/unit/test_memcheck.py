"""Bounds checks for interpreted Triton kernels (longserve/testing/memcheck.py): a store one element past its
output, or a load past the end of a view (inside the storage it views), is an error naming the kernel, the access
and the nearest argument; accesses a mask turns off are not."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from longserve.testing.memcheck import bounds_checked  # noqa: E402


@triton.jit
def _shift_copy(x_ptr, y_ptr, n, SHIFT: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs + SHIFT, mask=mask if MASKED else None)
    tl.store(y_ptr + offs, x, mask=mask)


def test_a_store_past_the_output_is_caught():
    x, y = torch.arange(16, dtype=torch.float32), torch.zeros(8)
    with bounds_checked():
        _shift_copy[(1,)](x, y, 8, SHIFT=0, BLOCK=8, MASKED=True)
        assert torch.equal(y, x[:8])
        with pytest.raises(
            Exception, match=r"_shift_copy: a store at .*nearest: y_ptr .*\+0 bytes from its end"
        ):
            _shift_copy[(1,)](x, y, 9, SHIFT=0, BLOCK=16, MASKED=True)  # n = 9: one past y's 8


def test_a_load_past_a_view_inside_its_storage_is_caught():
    base = torch.arange(32, dtype=torch.float32)
    x, y = base[:8], torch.zeros(8)  # x's storage goes on, x does not
    with bounds_checked():
        with pytest.raises(Exception, match=r"a load at .*nearest: x_ptr"):
            _shift_copy[(1,)](x, y, 8, SHIFT=1, BLOCK=8, MASKED=True)
        _shift_copy[(1,)](x, y, 7, SHIFT=1, BLOCK=8, MASKED=True)  # the mask keeps it inside
        assert torch.equal(y[:7], base[1:8])


def test_unmasked_loads_are_checked():
    buf = torch.arange(16, dtype=torch.float32)
    b, y = buf[8:], torch.zeros(8)
    with bounds_checked():
        _shift_copy[(1,)](b, y, 8, SHIFT=0, BLOCK=8, MASKED=False)
        assert torch.equal(y, b)
        with pytest.raises(Exception, match="a load at"):
            _shift_copy[(1,)](b, y, 8, SHIFT=-4, BLOCK=8, MASKED=False)  # before b: another view's memory
