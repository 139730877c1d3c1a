"""Security tests: hypothesis keeps no example database in the tree (runs are reproducible
from the seed it prints on failure)."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("hindsight", database=None)
settings.load_profile("hindsight")
