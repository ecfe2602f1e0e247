"""Rank-aware logging, configured once at an entry point (CLI or worker start).

Library modules only call ``logging.getLogger(__name__)``; this module decides
what reaches the terminal: by default rank 0 logs at INFO and other ranks at
WARNING, each line prefixed with ``[rank i]``.
"""

from __future__ import annotations

import logging
import sys


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(rank: int = 0, verbose: bool = False, all_ranks: bool = False) -> None:
    """Send ``cannikin.*`` logs to stderr with a rank prefix.

    ``verbose`` lowers the level to DEBUG; ``all_ranks`` lets non-zero ranks log at the
    same level as rank 0 (otherwise they only report warnings and errors).
    """
    level = logging.DEBUG if verbose else logging.INFO
    if rank != 0 and not all_ranks:
        level = logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(
        logging.Formatter("%(asctime)s [rank %(rank)s] %(name)s %(levelname)s: %(message)s")
    )
    root = logging.getLogger("cannikin")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
