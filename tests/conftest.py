"""Test-wide setup. Without a GPU, Triton kernels run only in Triton's interpreter, and triton must see
TRITON_INTERPRET=1 before it is first imported: a module that imports triton while being collected (e.g.
longserve.kernels.launch reads `triton.knobs`) would otherwise leave every later interpreted kernel failing
("Cannot call @triton.jit'd outside of the scope of a kernel"), depending on the order files are collected."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
