"""Splitting a model across nodes with ggml's RPC backend: a follower rank serves its
node's CPU as an RPC device (ggml_backend_rpc_start_server, in a thread of its runner),
and rank 0 adds each follower as a device and loads the model with the later layers on
them (engine/llamacpp/native.py's Model). Activations go between the nodes inside
llama.cpp's own graph; only rank 0 runs exo's loop.

The RPC protocol carries no authentication: a follower's port serves whoever reaches it,
outside what a cluster secret seals. Placement therefore puts a split on nodes with a
secret on MLX (engine/llamacpp/support.py's mlx_reason)."""

import ctypes
import socket
import threading
import time
from pathlib import Path

import llama_cpp

from exo.engine.llamacpp.cores import threads
from exo.engine.llamacpp.native import init_backend

_LIB_DIR = Path(llama_cpp.__file__).parent / "lib"
_CPU_DEVICE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU


def _library(name: str) -> ctypes.CDLL:
    return ctypes.CDLL(str(_LIB_DIR / name), mode=ctypes.RTLD_GLOBAL)


def _ggml() -> tuple[ctypes.CDLL, ctypes.CDLL, ctypes.CDLL]:
    """ggml's device registry, its backend basics and its RPC backend."""
    ggml, base, rpc = _library("libggml.so"), _library("libggml-base.so"), _library("libggml-rpc.so")
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    base.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    base.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_start_server.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    rpc.ggml_backend_rpc_start_server.restype = None
    return ggml, base, rpc


def serve(endpoint: str) -> threading.Thread:
    """Serves this node's CPU at `endpoint` ("host:port") until the process ends."""
    init_backend()
    ggml, _, rpc = _ggml()
    cpu = ggml.ggml_backend_dev_by_type(_CPU_DEVICE)
    devices = (ctypes.c_void_p * 1)(cpu)

    def run() -> None:
        # Blocks for good (ctypes releases the GIL while it does).
        rpc.ggml_backend_rpc_start_server(endpoint.encode(), None, threads(), 1, devices)

    thread = threading.Thread(target=run, name="ggml-rpc-server", daemon=True)
    thread.start()
    return thread


def wait_reachable(endpoint: str, timeout: float = 60.0) -> None:
    """Waits until something listens at `endpoint` (a follower starts its server when it
    connects, maybe after rank 0 does)."""
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no llama.cpp RPC server at {endpoint}") from None
            time.sleep(0.2)


def remote_devices(endpoints: list[str]) -> list[int]:
    """One device per follower, in rank order."""
    init_backend()
    _, base, rpc = _ggml()
    devices = []
    for endpoint in endpoints:
        wait_reachable(endpoint)
        registry = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not registry or base.ggml_backend_reg_dev_count(registry) < 1:
            raise RuntimeError(f"llama.cpp RPC server at {endpoint} offers no device")
        devices.append(int(base.ggml_backend_reg_dev_get(registry, 0)))
    return devices
