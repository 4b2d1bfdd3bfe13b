"""How much work an engine takes on at once, the same for every engine (and set the
same way on every node of a cluster)."""

import os

import psutil

# max_tokens when a request gives none.
DEFAULT_MAX_TOKENS = 1024
# Requests stepped together; later ones wait in arrival order.
MAX_BATCH = int(os.environ.get("EXO_MAX_BATCH", "8"))

# Per device, as MLX names what it computes on ("cpu", "metal", "cuda"). A step's tokens
# (prompt chunks and decode tokens together): progress and cancellations land between
# steps, prompts scheduled in one step have their first tokens after it, and a long
# prompt holds running streams up by one step at most. An NVIDIA GPU steps as mlx-lm's
# BatchGenerator does, 8 prompts of 2,048 tokens (its prefill_step_size, each prompt's
# chunk here), in about 0.2 s for the 3 GB float32 llama of bench/gpu.sh on an H200; a
# Mac's GPU, which prefills an 8B model at a few thousand tokens a second, keeps 2,048
# so its running streams are held up for under a second; 2 CPU cores take 512.
STEP_TOKENS = {"cpu": 512, "metal": 2048, "cuda": 16384}
CHUNK_TOKENS = {"cuda": 2048}  # elsewhere the step's
# The most tokens one forward computes (a padded batch: rows x its longest chunk): a
# step's chunks past it take more forwards, so a step's activations stay those of one.
FORWARD_TOKENS = {"cpu": 512, "metal": 2048, "cuda": 4096}


def step_tokens(device: str) -> int:
    configured = os.environ.get("EXO_PREFILL_STEP")
    return int(configured) if configured else STEP_TOKENS[device]


def chunk_tokens(device: str) -> int | None:
    """EXO_PREFILL_CHUNK: the most prompt tokens one request feeds a step (vLLM's
    long_prefill_token_threshold), so prompts that arrive together prefill in one step
    while a long one still holds running streams up by one chunk. Unset: the device's
    (None: the step's)."""
    configured = os.environ.get("EXO_PREFILL_CHUNK")
    return int(configured) if configured else CHUNK_TOKENS.get(device)


def forward_tokens(device: str, step: int, chunk: int | None) -> int:
    """A forward's tokens: the device's, or a chunk's where that is more; the step's at most."""
    return min(step, max(FORWARD_TOKENS[device], chunk or 0))


# An idle engine's first step waits for the requests sent with the one that woke it: until
# none has come for GATHER_SECONDS (GATHER_MAX_SECONDS at most), so they prefill in one
# step instead of the first alone and the rest a step later (the API passes them on ~3 ms
# apart here). A lone request's first token comes that much later; a busy engine takes a
# new request at its next step, as it would have. EXO_GATHER_MS=0: step at once.
GATHER_SECONDS = float(os.environ.get("EXO_GATHER_MS", "5")) / 1000
GATHER_MAX_SECONDS = 0.05

# The prefix cache: finished requests' prompt + answer kept, up to this many entries and
# bytes (as tokens of KV), and never past the runner's memory budget.
PREFIX_CACHE_ENTRIES = int(os.environ.get("EXO_PREFIX_CACHE_ENTRIES", "16"))
PREFIX_CACHE_BYTES = int(os.environ.get("EXO_PREFIX_CACHE_BYTES", str(2 << 30)))


def memory_budget_override() -> int | None:
    """EXO_MEMORY_BUDGET_MB: the memory a runner may use, weights included, in place of
    what its device has."""
    configured = os.environ.get("EXO_MEMORY_BUDGET_MB")
    return int(float(configured) * (1 << 20)) if configured else None


# Of the device's memory, the share a runner budgets for: the rest is the OS's and other
# processes' (on a Mac and a CPU node the memory is shared).
MEMORY_FRACTION = float(os.environ.get("EXO_MEMORY_FRACTION", "0.85"))


def ram_budget(weights_bytes: int) -> int:
    """Bytes a runner on a CPU node may use, weights included: EXO_MEMORY_BUDGET_MB, else
    its share of the RAM nothing else uses now plus its weights (already loaded)."""
    override = memory_budget_override()
    if override is not None:
        return override
    return int(psutil.virtual_memory().available * MEMORY_FRACTION) + weights_bytes
