"""A stand-in for torch.profiler.profile in tests of bench/profile.py: what the profiler would have seen (its
key_averages rows and its events) without a GPU."""

from __future__ import annotations

from typing import Any


def fake_profile(averages: list[Any], events: list[Any] = ()) -> type:
    """A class to patch over torch.profiler.profile: a context manager whose key_averages() and events() return
    these."""

    class FakeProfile:
        def __init__(self, **_: Any) -> None:
            pass

        def __enter__(self) -> FakeProfile:
            return self

        def __exit__(self, *exc: Any) -> bool:
            return False

        def key_averages(self) -> list[Any]:
            return list(averages)

        def events(self) -> list[Any]:
            return list(events)

    return FakeProfile
