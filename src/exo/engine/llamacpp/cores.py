"""How many threads llama.cpp runs, and how its runners share a machine's cores. No
llama_cpp import here: the spin setting must be in the environment before
libgomp (which ggml's CPU backend links) loads, so the runner applies it first."""

import os

import psutil

# OpenMP's spins before a waiting llama.cpp thread sleeps (ggml's barriers between ops are
# OpenMP barriers). libgomp's default, 300,000, keeps a waiting thread on a core another
# runner's thread needs. On this 2-core VM, two instances on one machine decoding at once
# (exo API, 2 threads each) made 1.2-4.8 tok/s each with the default, 9.0 with 10,000
# and 21-23 with 1,000; one instance alone made the same with 10,000 as with the default
# (41-45 tok/s) but 12% less with 1,000. A 2-rank split on one machine decoded at 0.25x
# one node with the default and 0.92x with 10,000.
IDLE_SPINS = "10000"


def threads() -> int:
    """llama.cpp's threads: EXO_LLAMACPP_THREADS, else one per physical core (hyperthreads
    add nothing to decode, and a spinning thread that shares a core stalls every step).
    On this 2-core VM 2 threads decode Q4_0 at 1.4x the rate of 1."""
    configured = int(os.environ.get("EXO_LLAMACPP_THREADS", "0"))
    return configured or psutil.cpu_count(logical=False) or max((os.cpu_count() or 2) // 2, 1)


def share_cores() -> None:
    """Before llama.cpp loads: waiting threads sleep soon instead of spinning, so other
    runners on the machine (another instance, another rank of a split) get the cores. A
    GOMP_SPINCOUNT already set is kept."""
    os.environ.setdefault("GOMP_SPINCOUNT", IDLE_SPINS)
