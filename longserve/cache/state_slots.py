"""Per-request recurrent-state slots for hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet layers beside full
attention), on the cache side: plain ids, no tensors (the runner's `attention.recurrent_state.RecurrentStates`
holds slot s's conv and recurrent states of every linear-attention layer at index s).

Unlike a KV page, a slot holds a request's whole history folded into a fixed-size state, so it cannot be
shared or cut: one slot a running request, taken with its first pages and given back with them (finish,
abort, preemption). A request whose slot holds no tokens starts from a zero state: the runner reads that
from the step's prefix lengths (a request's tokens already computed are exactly those its slot has folded
in, as long as nothing attaches pages computed elsewhere: no prefix cache and no forked siblings for these
models, `KVCacheManager.shares_prompts`).

`NoStateSlots` is the sibling for attention-only models: every request "has" a slot, none is held, so the
manager calls the same methods either way (as NoPrefixCache does for the prefix cache).
"""

from __future__ import annotations

from collections.abc import Iterable

from longserve.request import Request


class StateSlots:
    """Slot ids 0..num_slots-1, the lowest free first; a request holds at most one (`req.state_slot`)."""

    __slots__ = ("_num_total", "_free", "_held")

    #: whether requests hold slots (False for NoStateSlots)
    holds_states = True

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a hybrid model needs at least one state slot, got {num_slots}")
        self._num_total = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: the lowest id first
        self._held: set[int] = set()

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, req: Request) -> bool:
        """Give the request a slot if it has none; False, changing nothing, when every slot is held."""
        if req.state_slot is not None:
            return True
        if not self._free:
            return False
        slot = self._free.pop()
        self._held.add(slot)
        req.state_slot = slot
        return True

    def release(self, req: Request) -> None:
        """Take back the request's slot (its state is garbage from now on: the next holder starts from zero)."""
        slot = req.state_slot
        if slot is None:
            return
        self._held.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)  # at most max_running_requests ids: keeps 'lowest first'
        req.state_slot = None

    def check(self, live_requests: Iterable[Request]) -> None:
        """Every slot is free or held by exactly one live request."""
        holders: dict[int, str] = {}
        for req in live_requests:
            if req.state_slot is None:
                continue
            other = holders.setdefault(req.state_slot, req.request_id)
            assert other == req.request_id, (
                f"state slot {req.state_slot} held by {other} and {req.request_id}"
            )
        assert set(holders) == self._held, f"held slots {sorted(self._held)} but holders {sorted(holders)}"
        assert len(self._free) + len(self._held) == self._num_total
        assert not set(self._free) & self._held


class NoStateSlots:
    """Attention-only models: no request holds a slot."""

    __slots__ = ()

    holds_states = False
    num_total = 0
    num_free = 0

    def acquire(self, req: Request) -> bool:
        return True

    def release(self, req: Request) -> None:
        return None

    def check(self, live_requests: Iterable[Request]) -> None:
        for req in live_requests:
            assert req.state_slot is None, f"{req.request_id} holds state slot {req.state_slot}"
