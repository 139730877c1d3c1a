"""The agent core: bounded buffer, batching thread, HTTP transport and on-disk spool."""

from __future__ import annotations

from hindsight.agent.buffer import EventBuffer
from hindsight.agent.core import Agent, new_agent_name
from hindsight.agent.spool import Spool, SpooledBatch
from hindsight.agent.transport import Outcome, Transport, parse_retry_after

__all__ = [
    "Agent",
    "EventBuffer",
    "Outcome",
    "Spool",
    "SpooledBatch",
    "Transport",
    "new_agent_name",
    "parse_retry_after",
]
