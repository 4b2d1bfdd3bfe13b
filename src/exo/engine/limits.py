"""How much work an engine takes on at once, the same for every engine (and set the
same way on every node of a cluster)."""

import os

import psutil

# max_tokens when a request gives none.
DEFAULT_MAX_TOKENS = 1024
# Prompt tokens per prefill step: progress and cancellations land between steps.
PREFILL_STEP = int(os.environ.get("EXO_PREFILL_STEP", "512"))
# Requests stepped together; later ones wait in arrival order.
MAX_BATCH = int(os.environ.get("EXO_MAX_BATCH", "8"))

# The prefix cache (each engine's own): finished requests' prompt + answer kept, up to
# this many entries and bytes, giving entries up while the machine has less free memory
# than the reserve.
PREFIX_CACHE_ENTRIES = int(os.environ.get("EXO_PREFIX_CACHE_ENTRIES", "16"))
PREFIX_CACHE_BYTES = int(os.environ.get("EXO_PREFIX_CACHE_BYTES", str(2 << 30)))
PREFIX_CACHE_RESERVE_BYTES = int(os.environ.get("EXO_PREFIX_CACHE_RESERVE_BYTES", str(1 << 30)))


def prefix_cache_budget(held: int) -> int:
    """Bytes the prefix cache may hold now, given it holds `held`."""
    return min(PREFIX_CACHE_BYTES, held + psutil.virtual_memory().available - PREFIX_CACHE_RESERVE_BYTES)
