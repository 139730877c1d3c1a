"""Postgres advisory lock keys, in one place: two uses must never share a number."""

from __future__ import annotations

#: Serialises migrations (``storage.core.db``); partition changes take it shared and skip a
#: pass while a migration holds it (``storage.core.partitions``).
UPGRADE = 0x68696E6473676874
#: Serialises the collectors' partition passes (``storage.core.partitions.ensure``).
PARTITIONS = 0x68733F5A
