"""Host time of a hybrid model's state-row copy (RecurrentStates.copy: a prefix hit's restore, a checkpoint save):
two rows over 30 linear-attention layers of tiny states, so the launches and their host work, not the bytes,
are what is timed.

    python scripts/dev/state_copy_time.py  # on the CI CPU (forty-eighth session): 259-271 us a copy with a tensor a
                                           # layer, 54-70 us with one tensor a kind
"""

from __future__ import annotations

import time

import torch

from longserve.attention.recurrent_state import RecurrentStates, RecurrentStateSpec


def main(copies: int = 2000) -> None:
    spec = RecurrentStateSpec(conv_dim=64, conv_width=4, num_v_heads=4, k_dim=16, v_dim=16)
    states = RecurrentStates(30, spec, 8, torch.float32, torch.float32, "cpu", num_checkpoints=8)
    pairs = [(1, 9), (2, 10)]
    for _ in range(50):
        states.copy(pairs)
    start = time.perf_counter()
    for _ in range(copies):
        states.copy(pairs)
    print(f"a copy of 2 rows over 30 layers: {(time.perf_counter() - start) / copies * 1e6:.1f} us")


if __name__ == "__main__":
    main()
