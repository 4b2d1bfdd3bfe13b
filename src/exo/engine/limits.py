"""How much work an engine takes on at once, the same for every engine (and set the
same way on every node of a cluster)."""

import os

# max_tokens when a request gives none.
DEFAULT_MAX_TOKENS = 1024
# Prompt tokens per prefill step: progress and cancellations land between steps.
PREFILL_STEP = int(os.environ.get("EXO_PREFILL_STEP", "512"))
# Requests stepped together; later ones wait in arrival order.
MAX_BATCH = int(os.environ.get("EXO_MAX_BATCH", "8"))
