"""The collector's per-process cache of cluster, session and agent ids."""

from __future__ import annotations


class IdCache:
    """Ids of the clusters, sessions and agents this process has indexed batches for.

    Saves the three look-ups a batch would otherwise cost. A cached id is only ever used
    through the guarded manifest insert, which checks in the same statement that the id
    still names this tenant/cluster/session/agent, so a pruned or rebuilt index can never
    be written through a stale id.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self._ids: dict[tuple[int, str, str, str], tuple[int, int, int]] = {}
        self._touched: dict[tuple[str, int], float] = {}
        self._max = max_entries

    def get(self, key: tuple[int, str, str, str]) -> tuple[int, int, int] | None:
        return self._ids.get(key)

    def put(self, key: tuple[int, str, str, str], ids: tuple[int, int, int]) -> None:
        if len(self._ids) >= self._max:
            self._ids.clear()
            self._touched.clear()
        self._ids[key] = ids

    def forget(self, key: tuple[int, str, str, str]) -> None:
        self._ids.pop(key, None)

    def due(self, table: str, row_id: int, now: float, every: float = 10.0) -> bool:
        """Whether this process should refresh ``last_seen`` on the row (at most every 10 s)."""
        if now - self._touched.get((table, row_id), 0.0) < every:
            return False
        self._touched[(table, row_id)] = now
        return True
