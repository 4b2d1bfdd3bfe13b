"""How many threads llama.cpp runs, and how ranks of one instance on one machine share
its cores. No llama_cpp import here: the spin setting must be in the environment before
libgomp (which ggml's CPU backend links) loads, so the runner applies it first."""

import os

import psutil

# OpenMP's spins before an idle thread sleeps, for ranks sharing a machine. libgomp's
# default (300,000) kept an idle rank's threads on the cores the working rank's barriers
# waited for: two ranks with 2 threads each on this 2-core VM decoded a pipeline at a
# quarter of one node's rate. With 10,000 the pair decoded at 0.92x one node (27.5 vs
# 30.0 tok/s, a 1024x16 float32 llama); with 1,000 at 0.77x, and with 1 thread per rank
# at 0.59x.
SHARED_MACHINE_SPINS = "10000"


def threads() -> int:
    """llama.cpp's threads: EXO_LLAMACPP_THREADS, else one per physical core (hyperthreads
    add nothing to decode, and a spinning thread that shares a core stalls every step).
    On this 2-core VM 2 threads decode Q4_0 at 1.4x the rate of 1."""
    configured = int(os.environ.get("EXO_LLAMACPP_THREADS", "0"))
    return configured or psutil.cpu_count(logical=False) or max((os.cpu_count() or 2) // 2, 1)


def ranks_on_this_machine(hosts: list[str], rank: int) -> int:
    """How many ranks of an instance share this rank's address, and so its cores."""
    if not hosts:
        return 1
    address = hosts[rank].rsplit(":", 1)[0]
    return sum(1 for host in hosts if host.rsplit(":", 1)[0] == address)


def share_cores(hosts: list[str], rank: int) -> None:
    """Before llama.cpp loads: with other ranks of the instance on this machine, idle
    threads stop spinning soon (the ranks take turns: a pipeline's rank works while the
    others wait). A GOMP_SPINCOUNT already set is kept."""
    if ranks_on_this_machine(hosts, rank) > 1:
        os.environ.setdefault("GOMP_SPINCOUNT", SHARED_MACHINE_SPINS)
