"""llama.cpp through llama-cpp-python's ctypes bindings, as thin as exo needs: a model and
one context holding several sequences, a batch exo fills from numpy (tokens of any
sequences at once), the logits of each output row, and per-sequence KV removal, save
and restore.
The high-level `Llama` class serves one sequence and samples itself; exo samples."""

import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from loguru import logger

from exo.engine.llamacpp.cores import threads
from exo.engine.llamacpp.support import LlamaCppRefused

# What llama.cpp logs at load (every tensor, every layer) is noise on a node's log; its
# errors still go there. A CONT line continues the message before it (the progress dots
# of a load continue an info line), so it goes where that one went.
_LOG_ERROR, _LOG_CONT = 4, 5
_last_level = 0
# The error lines of the load under way, for the message that says why it failed.
_load_errors: list[str] = []


@llama_cpp.llama_log_callback
def _log(level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
    global _last_level
    if level != _LOG_CONT:
        _last_level = level
    if _last_level == _LOG_ERROR and text and text.strip():
        line = text.decode(errors="replace").rstrip()
        logger.error(f"llama.cpp: {line}")
        _load_errors.append(line)


_initialised = False


def init_backend() -> None:
    global _initialised
    if not _initialised:
        llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _initialised = True


def extra_buffer_types() -> bool:
    """Whether models load into llama.cpp's extra CPU buffer types (its repacked Q4_0 /
    IQ4_NL / Q8_0 layouts for AVX2 and AVX-512, and AMX where the build has it): on
    unless EXO_LLAMACPP_EXTRA_BUFTS=0. scripts/setup.sh builds without AMX: a
    -march=native build puts quantized weights in ggml's AMX buffer, whose matmul
    segfaulted on a Sapphire Rapids VM (llama.cpp issue 20824); =0 is the way out for
    such a build."""
    return os.environ.get("EXO_LLAMACPP_EXTRA_BUFTS", "1") != "0"


def flash_attention() -> bool:
    """Whether contexts use llama.cpp's flash attention: off unless
    EXO_LLAMACPP_FLASH_ATTN=1 (llama-cpp-python's `Llama` default too). Its CPU kernel
    made each decoded token cost more the longer the context on a 2-core Xeon VM: with
    8-bit weights, 39 against 47 tok/s at 250 tokens, 14 against 31 at 2,700, and 8
    streams 73 against 92 tok/s (docs/engines.md); it prefills 15-40% faster."""
    return os.environ.get("EXO_LLAMACPP_FLASH_ATTN", "0") == "1"


class Model:
    """A GGUF loaded, with layers optionally offloaded to other devices (RPC servers):
    llama.cpp keeps the first layers on this CPU and offloads the last `offload_layers`
    to `devices`, split between them in the proportions of `split`."""

    def __init__(
        self,
        gguf: Path,
        on_progress: Callable[[float], None] | None = None,
        devices: list[int] | None = None,
        offload_layers: int = 0,
        split: list[float] | None = None,
    ) -> None:
        init_backend()
        params: Any = llama_cpp.llama_model_default_params()
        params.use_mmap = True
        params.use_extra_bufts = extra_buffer_types()
        self._keep: list[object] = []
        if devices:
            device_list = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            split_array = (ctypes.c_float * llama_cpp.llama_max_devices())(*(split or [1.0] * len(devices)))
            self._keep += [device_list, split_array]
            params.devices = ctypes.cast(device_list, ctypes.c_void_p)
            params.n_gpu_layers = offload_layers
            params.split_mode = llama_cpp.LLAMA_SPLIT_MODE_LAYER
            params.tensor_split = split_array
        else:
            params.n_gpu_layers = 0
        if on_progress is not None:

            def progress(value: float, _user: ctypes.c_void_p) -> bool:
                on_progress(value)
                return True

            callback = llama_cpp.llama_progress_callback(progress)
            self._keep.append(callback)
            params.progress_callback = callback
        _load_errors.clear()
        model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
        if not model:
            # Its first error line is the cause ("error loading model vocabulary: ...");
            # the rest repeat that the load failed.
            cause = _load_errors[0] if _load_errors else "no error logged"
            raise LlamaCppRefused(f"llama.cpp could not load the GGUF: {cause}")
        self.ptr: Any = model
        self.vocab: Any = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_layers = llama_cpp.llama_model_n_layer(model)
        # Whether a sequence's KV can be cut back to any position (a recurrent state
        # cannot be rewound).
        self.trimmable = not (llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None


class Context:
    """One llama.cpp context: `sequences` sequences sharing one KV buffer of `n_ctx`
    cells (unified: a request may use what the others leave), in f16 unless `f32_kv`."""

    def __init__(self, model: Model, n_ctx: int, sequences: int, batch_tokens: int, f32_kv: bool = False) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = batch_tokens
        params.n_ubatch = min(batch_tokens, 512)
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads()
        params.kv_unified = True
        if f32_kv:
            # llama.cpp keeps keys and values in f16 by default, and its CPU flash
            # attention computes in f16: either moves a float32 model's logprobs by ~2e-3.
            params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
        flash = flash_attention() and not f32_kv
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.no_perf = True
        context = llama_cpp.llama_init_from_model(model.ptr, params)
        if not context:
            raise RuntimeError("llama.cpp could not create a context")
        self.ptr: Any = context
        memory = llama_cpp.llama_get_memory(context)
        assert memory is not None, "a decoder context has a memory"
        self.memory = memory
        self.n_vocab = model.n_vocab
        # One ctypes type for a row of logits: np.ctypeslib.as_array makes a new type
        # per call, 0.1 ms of every decoded token.
        self._logits_row = ctypes.c_float * model.n_vocab
        self.n_ctx = llama_cpp.llama_n_ctx(context)
        self.batch = Batch(batch_tokens)

    def decode(self) -> int:
        """Runs the batch; 0 on success, 1 when the KV cache has no room for it."""
        status = llama_cpp.llama_decode(self.ptr, self.batch.struct(self.batch.n))
        if status < 0 or status > 1:
            raise RuntimeError(f"llama_decode failed ({status})")
        return status

    def logits(self, index: int) -> np.ndarray:
        """The logits of the batch's `index`-th token (one that asked for them): a view
        of llama.cpp's buffer, valid until the next decode."""
        pointer = llama_cpp.llama_get_logits_ith(self.ptr, index)
        address = ctypes.cast(pointer, ctypes.c_void_p).value
        if not address:
            raise RuntimeError(f"llama.cpp has no logits for batch row {index}")
        row: Any = self._logits_row.from_address(address)
        return np.frombuffer(row, dtype=np.float32)

    def remove(self, sequence: int, start: int = -1, end: int = -1) -> None:
        """Forget positions [start, end) of a sequence (-1: from the start / to the end)."""
        llama_cpp.llama_memory_seq_rm(self.memory, sequence, start, end)

    def save(self, sequence: int) -> "SequenceState":
        """A copy of the sequence's KV (and positions) in host memory."""
        size = llama_cpp.llama_state_seq_get_size(self.ptr, llama_cpp.llama_seq_id(sequence))
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self.ptr, buffer, size, llama_cpp.llama_seq_id(sequence))
        return SequenceState(buffer, written)

    def restore(self, state: "SequenceState", sequence: int) -> bool:
        """Puts a saved KV into `sequence` (empty before); False when the KV has no room."""
        return (
            llama_cpp.llama_state_seq_set_data(self.ptr, state.buffer, state.nbytes, llama_cpp.llama_seq_id(sequence))
            != 0
        )

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_free(self.ptr)
            self.ptr = None


class SequenceState:
    """One sequence's saved KV: a ctypes buffer llama.cpp wrote `nbytes` of."""

    def __init__(self, buffer: ctypes.Array[ctypes.c_uint8], nbytes: int) -> None:
        self.buffer = buffer
        self.nbytes = nbytes


class Batch:
    """A llama_batch over numpy arrays, one sequence id per token: filling it is slice
    assignment, not a ctypes call per field."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.output = np.zeros(capacity, dtype=np.int8)
        base = self.seq.ctypes.data
        int_pointer = ctypes.POINTER(ctypes.c_int32)
        self._seq_pointers = (int_pointer * capacity)(
            *(ctypes.cast(base + 4 * i, int_pointer) for i in range(capacity))
        )
        # Typed as llama-cpp-python declares it (arrays), filled with pointers.
        self._struct: Any = llama_cpp.llama_batch()
        self._struct.token = self.token.ctypes.data_as(int_pointer)
        self._struct.embd = ctypes.POINTER(ctypes.c_float)()
        self._struct.pos = self.pos.ctypes.data_as(int_pointer)
        self._struct.n_seq_id = self.n_seq_id.ctypes.data_as(int_pointer)
        self._struct.seq_id = self._seq_pointers
        self._struct.logits = self.output.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, tokens: list[int], start_pos: int, sequence: int, outputs: int) -> int:
        """Appends tokens of one sequence at positions start_pos..; returns the index of
        the last one. The last `outputs` tokens' logits are output (a bool: the last one's
        or none)."""
        n, k = self.n, len(tokens)
        assert n + k <= self.capacity, "batch overflow"
        self.token[n : n + k] = tokens
        self.pos[n : n + k] = np.arange(start_pos, start_pos + k, dtype=np.int32)
        self.seq[n : n + k] = sequence
        self.output[n : n + k] = 0
        if outputs:
            self.output[n + k - int(outputs) : n + k] = 1
        self.n = n + k
        return n + k - 1

    def struct(self, n_tokens: int) -> llama_cpp.llama_batch:
        self._struct.n_tokens = n_tokens
        return self._struct
