"""Dask's vocabulary, as the scheduler's agent reports it: what its reasons and statuses for a
worker's departure mean (``storage.runs.runlogs.cause_of`` reads them as the protocol's
causes)."""

from __future__ import annotations

#: ``Scheduler.remove_worker`` stimuli of a worker lost: its connection closed, or a send to
#: it failed.
LOST_REASONS = ("handle-worker-cleanup", "worker-send-comm-fail", "send-all-comm-fail")
#: The stimulus of a worker removed because its heartbeats stopped (``worker-ttl``).
TTL_REASON = "check-worker-ttl"
#: A worker's last statuses when it was closing on its own.
CLOSING_STATUSES = ("closing", "closing_gracefully", "closed")
#: The status of a worker Dask paused for memory (past ``distributed.worker.memory.pause``).
PAUSED_STATUS = "paused"
