"""longserve/progress.py: a long start-up step (graph capture, cuDNN plans) logs where it is at most every few
seconds, and nothing when it is quick; its uses log through it (the capture loops' own test runs on CUDA only)."""

from __future__ import annotations

import logging

from longserve.progress import Progress


def test_lines_at_most_every_interval_and_none_at_the_end(caplog) -> None:
    now = [100.0]
    logger = logging.getLogger("longserve.test_progress")
    progress = Progress(logger, "capturing things", 6, every=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=logger.name):
        for done, t in enumerate((101.0, 106.0, 107.0, 111.5, 112.0, 120.0), start=1):
            now[0] = t
            progress.step(done)
    # 6 s after the start (step 2), then 5.5 s after that line (step 4); the last step is the caller's own line
    assert [r.getMessage() for r in caplog.records] == [
        "capturing things: 2 of 6",
        "capturing things: 4 of 6",
    ]


def test_a_quick_operation_logs_nothing(caplog) -> None:
    logger = logging.getLogger("longserve.test_progress")
    progress = Progress(logger, "quick", 3, every=60.0)
    with caplog.at_level(logging.INFO, logger=logger.name):
        for done in range(1, 4):
            progress.step(done)
    assert caplog.records == []
