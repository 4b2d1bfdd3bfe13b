"""The `exo` command."""

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path

from loguru import logger

# exo uses transformers for tokenizers only, and transformers imports torch whenever it is
# installed (a test or dev environment): seconds of start-up and ~300 MB per process.
sys.modules.setdefault("torch", None)  # type: ignore[assignment]
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found"

from exo.shared.cluster_secret import SECRET_ENV  # noqa: E402

# auto: MLX where it has a GPU (Apple silicon, or its CUDA build on an NVIDIA GPU), else
# llama.cpp (MLX's CPU backend is tens of times slower at decode: docs/engines.md); see
# worker/hardware.py. A model llama.cpp cannot run, and a split under a cluster secret,
# still run on MLX (engine/llamacpp/support.py).
DEFAULT_ENGINE = "auto"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="exo",
        description="Run an exo node. EXO_HOME (default ~/.exo) holds its config, data, cache and logs.",
    )
    parser.add_argument("--api-port", type=int, default=52415, help="HTTP API and dashboard port")
    parser.add_argument("--api-host", default="0.0.0.0", help="address the HTTP API binds to")
    parser.add_argument("--listen-port", type=int, default=0, help="cluster transport TCP port (default: any free)")
    parser.add_argument("--discovery-port", type=int, default=0, help="UDP multicast discovery port (default 7446)")
    parser.add_argument(
        "--bootstrap-peers", default="", help="comma-separated tcp/HOST:PORT peers to join, besides multicast discovery"
    )
    parser.add_argument("--namespace", default="exo", help="keeps clusters on one network apart")
    parser.add_argument(
        "--no-multicast", action="store_true", help="do not discover peers by multicast; use --bootstrap-peers only"
    )
    parser.add_argument("--discovery-interface", default="auto", help="network interface for multicast discovery")
    parser.add_argument(
        "--offline",
        action="store_true",
        default=os.environ.get("EXO_OFFLINE", "").lower() in ("1", "true", "yes", "on"),
        help="never reach a model hub; use local models only (also EXO_OFFLINE=1)",
    )
    parser.add_argument("--no-worker", action="store_true", help="serve the API and coordinate, but run no models")
    parser.add_argument("--force-master", action="store_true", help="always win master elections")
    parser.add_argument("--place-model", metavar="MODEL_ID", help="place this model once the node is up")
    auto_place = parser.add_mutually_exclusive_group()
    auto_place.add_argument(
        "--auto-place",
        dest="auto_place",
        action="store_true",
        default=None,
        help="place a requested model that has no instance (default: only on a one-node cluster)",
    )
    auto_place.add_argument(
        "--no-auto-place", dest="auto_place", action="store_false", help="never place models on request"
    )
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="require this key on every API request but GET /node_id; repeat for several "
        "(also EXO_API_KEY, comma-separated; the environment keeps keys out of `ps`)",
    )
    parser.add_argument(
        "--cluster-secret",
        default=os.environ.get(SECRET_ENV) or None,
        metavar="SECRET",
        help="seal every message between nodes with this secret; only nodes given the same "
        "one form a cluster (also EXO_CLUSTER_SECRET)",
    )
    parser.add_argument(
        "--engine",
        choices=["auto", "mlx", "llamacpp"],
        default=os.environ.get("EXO_ENGINE", DEFAULT_ENGINE),
        help="what runs models on this node: MLX, llama.cpp, or auto (MLX where it has a GPU: "
        f"Apple silicon, or CUDA; llama.cpp elsewhere); also EXO_ENGINE; default {DEFAULT_ENGINE}",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.api_keys is None:
        args.api_keys = os.environ.get("EXO_API_KEY", "").split(",")
    args.api_keys = [key.strip() for key in args.api_keys if key.strip()]
    return args


def exo_home() -> Path:
    return Path(os.environ.get("EXO_HOME", Path.home() / ".exo")).expanduser().resolve()


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As uvicorn binds: a port left in TIME_WAIT by an earlier node is free to take.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def main(argv: list[str] | None = None) -> None:
    # The node's modules are imported here, not above: spawning a runner process imports
    # this module again in the child (as __mp_main__), which needs none of them (the API,
    # the master: most of a second of a restarted node's start).
    from exo.worker.hardware import choose_engine, probe
    from exo.worker.supervisor import SpareRunner, ran_runners

    args = parse_args(argv)
    # Before anything starts (transport, election, runners): a second node on a busy port
    # would otherwise join the cluster for a moment and then die with a bind error.
    if port_in_use(args.api_host, args.api_port):
        sys.exit(
            f"exo: port {args.api_port} is already in use (another exo node?); "
            "give this node its own port with --api-port N"
        )
    if args.cluster_secret:
        # Runner processes inherit it: the MLX ring's broadcasts are sealed with it too.
        os.environ[SECRET_ENV] = args.cluster_secret
    home = exo_home()
    home.mkdir(parents=True, exist_ok=True)
    logger.remove()
    logger.add(sys.stderr, level="DEBUG" if args.verbose else "INFO")
    logger.add(home / "logs" / "exo.log", level="DEBUG", rotation="20 MB", retention=3)
    engine, why = choose_engine(args.engine, probe())
    logger.info(f"engine: {engine.value} ({why})")
    # Before the node's own imports: the spare imports its engine meanwhile.
    spare = SpareRunner(engine, args.verbose) if not args.no_worker and ran_runners(home) else None
    from exo.node import Node, NodeConfig

    config = NodeConfig(
        exo_home=home,
        api_port=args.api_port,
        api_host=args.api_host,
        listen_port=args.listen_port,
        discovery_port=args.discovery_port,
        bootstrap_peers=tuple(p for p in args.bootstrap_peers.split(",") if p),
        namespace=args.namespace,
        multicast=not args.no_multicast,
        discovery_interface=args.discovery_interface,
        offline=args.offline,
        run_worker=not args.no_worker,
        force_master=args.force_master,
        verbose=args.verbose,
        place_model=args.place_model,
        auto_place=args.auto_place,
        api_keys=tuple(args.api_keys),
        cluster_secret=args.cluster_secret,
        engine=engine,
    )
    try:
        asyncio.run(Node(config, spare).run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
