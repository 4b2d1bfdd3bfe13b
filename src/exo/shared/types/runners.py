"""The life of a runner subprocess, as every node sees it in State."""

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.types.common import FrozenModel


class RunnerIdle(FrozenModel):
    kind: Literal["RunnerIdle"] = "RunnerIdle"


class RunnerConnecting(FrozenModel):
    kind: Literal["RunnerConnecting"] = "RunnerConnecting"


class RunnerConnected(FrozenModel):
    kind: Literal["RunnerConnected"] = "RunnerConnected"


class RunnerLoading(FrozenModel):
    kind: Literal["RunnerLoading"] = "RunnerLoading"
    layers_loaded: int = 0
    total_layers: int = 0
    # Bytes written of the weights converted for the engine before it loads them
    # (llama.cpp's GGUF, made once per checkpoint); both 0 when nothing is converted.
    converted_bytes: int = 0
    total_convert_bytes: int = 0


class RunnerLoaded(FrozenModel):
    kind: Literal["RunnerLoaded"] = "RunnerLoaded"


class RunnerWarmingUp(FrozenModel):
    kind: Literal["RunnerWarmingUp"] = "RunnerWarmingUp"


class PrefixCacheStats(FrozenModel):
    """A serving runner's prefix cache since it loaded, from its finished requests'
    usage: those that found part of their prompt cached (hits) or none (misses), and
    the prompt tokens served from it."""

    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0


class RunnerMemory(FrozenModel):
    """A serving runner's memory budget and what holds it. The budget is the device's
    memory for this runner (Metal's working set, the CUDA device's memory, RAM on a CPU
    node) less its weights and one step's activations; the KV of running requests and
    the prefix cache share it, counted in tokens (`kv_tokens` fit)."""

    budget_bytes: int = 0
    weights_bytes: int = 0
    kv_bytes_per_token: int = 0
    kv_tokens: int = 0
    # The most a prompt and its answer can be: the running requests' share of kv_tokens
    # (on llama.cpp, its context's cells).
    running_tokens: int = 0
    # Held for the running requests: each one's prompt and whole answer.
    reserved_tokens: int = 0
    prefix_cache_tokens: int = 0
    prefix_cache_bytes: int = 0


class RunnerReady(FrozenModel):
    kind: Literal["RunnerReady"] = "RunnerReady"
    prefix_cache: PrefixCacheStats | None = None
    memory: RunnerMemory | None = None
    # Why the runner serves on MLX though its instance names llama.cpp (llama.cpp
    # refused the model); None when it runs its instance's engine.
    engine_reason: str | None = None


class RunnerRunning(FrozenModel):
    kind: Literal["RunnerRunning"] = "RunnerRunning"
    # Requests the engine steps (prefilling or in its decode batch), and those waiting
    # for room beyond its admission limit.
    active_tasks: int = 1
    queued_tasks: int = 0
    prefix_cache: PrefixCacheStats | None = None
    memory: RunnerMemory | None = None
    engine_reason: str | None = None  # as RunnerReady's


class RunnerShuttingDown(FrozenModel):
    kind: Literal["RunnerShuttingDown"] = "RunnerShuttingDown"


class RunnerShutdown(FrozenModel):
    kind: Literal["RunnerShutdown"] = "RunnerShutdown"


class RunnerFailed(FrozenModel):
    kind: Literal["RunnerFailed"] = "RunnerFailed"
    error_message: str
    attempt: int = 1


RunnerStatus = Annotated[
    RunnerIdle
    | RunnerConnecting
    | RunnerConnected
    | RunnerLoading
    | RunnerLoaded
    | RunnerWarmingUp
    | RunnerReady
    | RunnerRunning
    | RunnerShuttingDown
    | RunnerShutdown
    | RunnerFailed,
    Field(discriminator="kind"),
]

SERVING_STATUSES = (RunnerReady, RunnerRunning)
