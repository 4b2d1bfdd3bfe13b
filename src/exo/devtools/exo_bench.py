"""exo-bench: prompt-processing and token-generation sweeps through exo's API, and the
same sweep on the raw engine on the same weights, side by side: mlx-lm and
mlx_lm.server for MLX nodes, llama.cpp (exo's GGUF of the same dir) for llama.cpp ones.

    exo-bench                                   # a random tiny llama, one node started here
    exo-bench --pp 128,2048 --tg 64 --concurrency 1,8 --prefix-cache on,off
    exo-bench --placements single,pipeline,tensor --side-by-side --json out.json
    exo-bench --model-dir ~/models/org--name     # real weights, nodes started here
    exo-bench --url http://host:52415 --model org/name --eos-ids 2   # an existing cluster
    exo-bench --placements decode-node,prefill-node,disaggregated --pp 8192 --node-cpus 0-1/1
        # prefill on node 0, decode on node 1 (issue 36): TTFT, the KV's bytes and seconds;
        # every placement on MLX, the one engine that hands KV over

Every cell of the sweep (pp x tg x concurrency x prefix-cache) sends `concurrency`
greedy chat requests at once, each a prompt of about pp tokens, decoding exactly tg
tokens (EOS banned with a logit bias of -100, as upstream exo's bench does). With
--prefix-cache off every prompt is new (its first word is unique); with on, the same
prompts were sent once before (not measured), so the measured round finds them cached.
Cells are run --rounds times, alternated, and the round with the best aggregate decode
is kept. bench/README.md says what each column means."""

import argparse
import importlib.util
import json
import math
import platform
import tempfile
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

from exo.devtools.bench_client import Round, messages_for, words_for_tokens
from exo.devtools.bench_targets import (
    NODE_PLACEMENTS,
    PLACEMENTS,
    ExoTarget,
    RawLlamaCppTarget,
    RawTarget,
    ServerTarget,
    loopback_nodes,
)
from exo.devtools.device_memory import DeviceMemoryWatch
from exo.devtools.tiny_models import make_tiny_llama

TINY_ID = "bench/tiny-llama"


class Target(Protocol):
    @property
    def name(self) -> str: ...

    def open(self) -> None: ...

    def round(self, messages: list[list[dict[str, str]]], max_tokens: int, banned: list[int]) -> Round: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Cell:
    pp: int
    tg: int
    concurrency: int
    prefix_cache: str  # "on" or "off"

    def tags(self, nonce: str, round_index: int) -> list[str]:
        """The first word of each stream's prompt: shared by every target, so their texts
        can be compared; new each round unless the prefix cache is being measured."""
        seed = f"{nonce}w" if self.prefix_cache == "on" else f"{nonce}r{round_index}"
        return [f"{seed}p{self.pp}s{i}" for i in range(self.concurrency)]


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="exo-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=_ints, default=[128], help="prompt tokens, comma-separated")
    parser.add_argument("--tg", type=_ints, default=[64], help="generated tokens, comma-separated")
    parser.add_argument("--concurrency", type=_ints, default=[1, 8], help="requests at once, comma-separated")
    parser.add_argument("--prefix-cache", default="off", help="on, off or on,off")
    parser.add_argument(
        "--placements",
        default="single",
        help="single, pipeline, tensor, disaggregated (prefill on the first node, decode on another), "
        "prefill-node, decode-node (the model whole on that node alone); comma-separated",
    )
    parser.add_argument(
        "--node-cpus",
        help="the cores of each node started here, /-separated taskset lists (0-1/0: node 0 on both "
        "cores, node 1 on one), with as many BLAS threads: a mixed cluster on one machine",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="also the raw engine: mlx-lm and mlx_lm.server (MLX nodes) or llama.cpp (llama.cpp nodes)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--speculative", type=int, default=0, help="also each placement with prompt lookup, this many tokens proposed"
    )
    parser.add_argument("--verify", action="store_true", help="check each stream's text against its solo run")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--url", help="an existing exo cluster (else nodes are started on loopback)")
    parser.add_argument("--model", help="the model id to place (default: the tiny llama made here)")
    parser.add_argument("--model-dir", type=Path, help="the weights (for nodes started here and --side-by-side)")
    parser.add_argument("--eos-ids", type=_ints, help="tokens to ban (default: the model dir's EOS ids)")
    parser.add_argument("--api-key")
    parser.add_argument("--engine", help="the engine the nodes started here run (EXO_ENGINE: mlx, llamacpp)")
    parser.add_argument("--hidden", type=int, default=256, help="the tiny llama's width")
    parser.add_argument("--layers", type=int, default=4, help="the tiny llama's depth")
    parser.add_argument("--context", type=int, default=4096, help="the tiny llama's context, in tokens")
    args = parser.parse_args(argv)
    args.prefix_cache = [p for p in args.prefix_cache.split(",") if p]
    args.placements = [p for p in args.placements.split(",") if p]
    if set(args.prefix_cache) - {"on", "off"} or set(args.placements) - {*PLACEMENTS, *NODE_PLACEMENTS}:
        parser.error("--prefix-cache takes on/off, --placements " + "/".join([*PLACEMENTS, *NODE_PLACEMENTS]))
    args.node_cpus = args.node_cpus.split("/") if args.node_cpus else None
    if args.url and not args.model:
        parser.error("--url needs --model")
    if args.side_by_side and args.url and not args.model_dir:
        parser.error("--side-by-side needs the weights: --model-dir")
    if "disaggregated" in args.placements and args.url is None:
        # Only MLX hands KV over: the nodes alone must run it too to compare with it (a
        # Linux node's own default, llama.cpp, prefills at another speed).
        if args.engine not in (None, "mlx"):
            parser.error("--placements disaggregated runs on MLX: --engine mlx (or leave it out)")
        args.engine = "mlx"
    return args


def _engine(args: argparse.Namespace) -> str:
    """The engine the nodes started here run: --engine, else a node's own default (auto:
    llama.cpp on Linux where llama-cpp-python is installed)."""
    if args.engine:
        return args.engine
    linux_llamacpp = platform.system() == "Linux" and importlib.util.find_spec("llama_cpp") is not None
    return "llamacpp" if linux_llamacpp else "mlx"


def eos_ids(model_dir: Path) -> list[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or [])
    return sorted(ids)


def _models_dir(model_dir: Path, scratch: Path) -> tuple[Path, str]:
    """A models dir holding the weights under a name exo reads as a model id."""
    if "--" in model_dir.name:
        return model_dir.parent, model_dir.name.replace("--", "/", 1)
    link = scratch / "models" / f"local--{model_dir.name}"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(model_dir.resolve())
    return link.parent, f"local/{model_dir.name}"


def run_target(target: Target, cells: list[Cell], args: argparse.Namespace, nonce: str) -> list[dict[str, Any]]:
    """Every cell --rounds times, alternated; the best round of each by aggregate decode;
    the GPU memory the target took (where nvidia-smi answers)."""
    with DeviceMemoryWatch() as watch:
        rounds = _run_rounds(target, cells, args, nonce)
    memory = target.runner_memory if isinstance(target, ExoTarget) else None
    return [_row(target.name, cell, runs, memory, watch.taken_bytes) for cell, runs in rounds.items() if runs]


def _run_rounds(
    target: Target, cells: list[Cell], args: argparse.Namespace, nonce: str
) -> dict[Cell, list[tuple[Round, dict[str, Any]]]]:
    banned = args.eos_ids
    target.open()
    try:
        target.round([messages_for(8, f"{nonce}warmup")], 4, banned)
        rounds: dict[Cell, list[tuple[Round, dict[str, Any]]]] = {cell: [] for cell in cells}
        for index in range(args.rounds):
            for cell in cells:
                if cell.prefix_cache == "on" and isinstance(target, (RawTarget, RawLlamaCppTarget)):
                    continue  # the raw targets keep no cache between calls
                messages = [messages_for(args.words[cell.pp], tag) for tag in cell.tags(nonce, index)]
                checks: dict[str, Any] = {}
                if cell.prefix_cache == "on" and index == 0:
                    cold = target.round(messages, cell.tg, banned)
                    checks["cold_ttft_s"] = sum(r.ttft for r in cold.requests) / len(cold.requests)
                    checks["cold_texts"] = [r.text for r in cold.requests]
                measured = target.round(messages, cell.tg, banned)
                if "cold_texts" in checks:
                    checks["warm_equals_cold"] = [r.text for r in measured.requests] == checks.pop("cold_texts")
                if args.verify and cell.concurrency > 1 and index == 0:
                    solo = [target.round([m], cell.tg, banned).requests[0].text for m in messages]
                    checks["identical_to_solo"] = solo == [r.text for r in measured.requests]
                rounds[cell].append((measured, checks))
    finally:
        target.close()
    return rounds


def _or_zero(rate: float) -> float:
    return 0.0 if math.isnan(rate) else rate


def _row(
    name: str,
    cell: Cell,
    runs: list[tuple[Round, dict[str, Any]]],
    memory: dict[str, int] | None = None,
    gpu_taken: int | None = None,
) -> dict[str, Any]:
    best = max(runs, key=lambda run: _or_zero(run[0].aggregate_tps))[0]
    checks = {key: value for _, found in runs for key, value in found.items()}
    if memory is not None:
        # What the cell's requests need at most: the weights and each one's whole KV.
        held = max(sum(r.prompt_tokens + r.tokens for r in run.requests) for run, _ in runs)
        checks["weights_and_kv_bytes"] = memory["weights"] + memory["kv_per_token"] * held
    if gpu_taken is not None:
        # Over the target's whole run (nvidia-smi), every cell alike.
        checks["gpu_memory_taken_bytes"] = gpu_taken
    return {
        "target": name,
        "pp": cell.pp,
        "tg": cell.tg,
        "concurrency": cell.concurrency,
        "prefix_cache": cell.prefix_cache,
        **best.summary(),
        **checks,
        # Round 0's: every target was sent the same prompts in it.
        "texts": [r.text for r in runs[0][0].requests],
        "rounds": [run.summary() for run, _ in runs],
    }


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Concurrency N vs 1 within a target; each target vs raw mlx-lm and vs exo single;
    prefix cache on vs off (time to first token); an exo runner's peak memory."""
    by_key = {(r["target"], r["pp"], r["tg"], r["concurrency"], r["prefix_cache"]): r for r in rows}
    found = []
    for (target, pp, tg, conc, prefix), row in by_key.items():
        cell = f"pp={pp} tg={tg} c={conc} prefix={prefix}"
        solo = by_key.get((target, pp, tg, 1, prefix))
        if conc > 1 and solo:
            found.append(_ratio(f"{target}: {conc} streams vs 1 (aggregate)", cell, row, solo, "aggregate_tps"))
        # exo and mlx_lm.server against the raw engines; exo's splits against exo on one node.
        bases = ["mlx-lm", "llama.cpp"] + (["exo single"] if target.startswith("exo ") else [])
        for base in bases:
            other = by_key.get((base, pp, tg, conc, prefix))
            if other and base != target:
                found.append(_ratio(f"{target} vs {base} (aggregate)", cell, row, other, "aggregate_tps"))
                if conc > 1:
                    found.append(_ratio(f"{target} vs {base} (end to end)", cell, row, other, "end_to_end_tps"))
                found.append(_texts_match(f"{target} vs {base}", cell, row, other))
        found += _disaggregation_ratios(by_key, target, (pp, tg, conc, prefix), cell, row)
        if "cold_ttft_s" in row:
            found.append(
                {
                    "what": f"{target}: TTFT cold / warm, same prompt",
                    "cell": cell,
                    "ratio": row["cold_ttft_s"] / row["ttft_s"],
                }
            )
        cold = by_key.get((target, pp, tg, conc, "off"))
        if prefix == "on" and cold:
            found.append(
                {"what": f"{target}: TTFT prefix off / on", "cell": cell, "ratio": cold["ttft_s"] / row["ttft_s"]}
            )
    return found + _memory_ratios(rows)


def _memory_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each one-runner exo target's peak memory (MLX's, over its whole run), and the GPU
    memory it took (nvidia-smi, where it answers), against the most its cells' requests
    needed at once: the weights and every request's whole KV."""
    found = []
    for target in dict.fromkeys(r["target"] for r in rows):
        measured = [r for r in rows if r["target"] == target and r.get("weights_and_kv_bytes")]
        if not measured:
            continue
        need = max(measured, key=lambda r: r["weights_and_kv_bytes"])
        cell = f"pp={need['pp']} tg={need['tg']} c={need['concurrency']} prefix={need['prefix_cache']}"
        # Every round's, not only the best one's: the peak only grows over the run.
        peak = max((run.get("peak_memory_bytes") or 0 for r in measured for run in r["rounds"]), default=0)
        taken = need.get("gpu_memory_taken_bytes")
        for what, used in (("peak memory", peak), ("GPU memory taken (nvidia-smi)", taken)):
            if used:
                ratio = used / need["weights_and_kv_bytes"]
                found.append({"what": f"{target}: {what} / (weights + the requests' KV)", "cell": cell, "ratio": ratio})
    return found


def _disaggregation_ratios(
    by_key: dict[tuple, dict[str, Any]], target: str, key: tuple, cell: str, row: dict[str, Any]
) -> list[dict[str, Any]]:
    """Disaggregated TTFT against the time its KV took to arrive (the prefill node's
    prefill and the transfer), the decode node alone, and the prefill node's own TTFT
    alone plus the wait the transfer added past prefill."""
    prefill, decode = by_key.get(("exo prefill-node", *key)), by_key.get(("exo decode-node", *key))
    if target != "exo disaggregated":
        return []
    found = []
    if row.get("kv_s"):
        # The same request's own prefill and transfer: what noise on a shared machine cannot skew.
        found.append(
            {
                "what": "TTFT disaggregated / (its prefill + transfer)",
                "cell": cell,
                "ratio": row["ttft_s"] / row["kv_s"],
            }
        )
    if decode:
        found.append(
            {"what": "TTFT decode node alone / disaggregated", "cell": cell, "ratio": decode["ttft_s"] / row["ttft_s"]}
        )
        found.append(_texts_match("exo disaggregated vs exo decode-node", cell, row, decode))
    if prefill:
        transfer = max(row["kv_s"] - row["kv_prefill_s"], 0.0)
        bound = prefill["ttft_s"] + transfer
        found.append(
            {"what": "TTFT disaggregated / (prefill node's + transfer)", "cell": cell, "ratio": row["ttft_s"] / bound}
        )
    return found


def _ratio(what: str, cell: str, row: dict[str, Any], base: dict[str, Any], key: str) -> dict[str, Any]:
    return {"what": what, "cell": cell, "ratio": row[key] / max(base[key], 1e-9)}


def _texts_match(what: str, cell: str, row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {"what": f"{what}: same texts", "cell": cell, "same": row["texts"] == base["texts"]}


def print_table(rows: list[dict[str, Any]], found: list[dict[str, Any]]) -> None:
    header = (
        f"{'target':<16} {'pp':>5} {'tg':>4} {'c':>2} {'cache':>5} {'prompt':>6} {'cached':>6}"
        f" {'TTFT s':>7} {'max s':>7} {'pp tok/s':>9} {'tg tok/s':>8} {'agg tok/s':>9} {'e2e tok/s':>9}  checks"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        checks = " ".join(f"{key}={r[key]}" for key in ("identical_to_solo", "warm_equals_cold") if key in r)
        if r.get("proposals_kept") is not None:
            checks += f" kept={r['proposals_kept']:.0%}"
        if r.get("kv_bytes"):
            checks += f" kv={r['kv_bytes'] / 1e6:.2f}MB in {r['kv_s']:.3f}s (prefill {r['kv_prefill_s']:.3f}s)"
        print(
            f"{r['target']:<16} {r['pp']:>5} {r['tg']:>4} {r['concurrency']:>2} {r['prefix_cache']:>5}"
            f" {r['prompt_tokens']:>6} {r['cached_tokens']:>6} {r['ttft_s']:>7.3f} {r['ttft_max_s']:>7.3f} {r['prefill_tps']:>9.1f}"
            f" {r['decode_tps']:>8.1f} {r['aggregate_tps']:>9.1f} {r['end_to_end_tps']:>9.1f}  {checks}"
        )
    print()
    for entry in found:
        value = f"{entry['ratio']:.2f}x" if "ratio" in entry else str(entry["same"])
        print(f"{entry['what']:<52} {entry['cell']:<32} {value}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cells = [
        Cell(pp, tg, conc, prefix)
        for prefix in args.prefix_cache
        for pp in args.pp
        for tg in args.tg
        for conc in args.concurrency
    ]
    with tempfile.TemporaryDirectory(prefix="exo-bench-") as tmp:
        scratch = Path(tmp)
        model_dir: Path | None = args.model_dir
        if model_dir is None and args.url is None:
            model_dir = make_tiny_llama(
                scratch / "models" / TINY_ID.replace("/", "--"),
                hidden_size=args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=8,
                num_key_value_heads=4,
                intermediate_size=args.hidden * 3,
                max_position_embeddings=args.context,
            )
        models_dir, model_id = _models_dir(model_dir, scratch) if model_dir is not None else (None, "")
        args.model = args.model or model_id
        if args.eos_ids is None:
            args.eos_ids = eos_ids(model_dir) if model_dir is not None else []
        nonce = uuid.uuid4().hex[:6]
        nodes = max([2 if p != "single" else 1 for p in args.placements] + [len(args.node_cpus or [])])
        started = time.time()
        nodes_or_url = (
            loopback_nodes(nodes, scratch, models_dir, args.engine, args.node_cpus)
            if args.url is None
            else nullcontext(args.url)
        )
        with nodes_or_url as url:
            exo = [ExoTarget(url, args.model, placement, args.api_key) for placement in args.placements]
            if args.speculative:
                exo += [ExoTarget(url, args.model, p, args.api_key, args.speculative) for p in args.placements]
            # Prompt sizes are found on exo's own template once, then sent to every target.
            exo[0].open()
            args.words = {pp: words_for_tokens(url, args.model, pp, exo[0].headers) for pp in args.pp}
            exo[0].close()
            targets: list[Target] = []
            if args.side_by_side:
                assert model_dir is not None
                if _engine(args) == "llamacpp":
                    targets += [RawLlamaCppTarget(model_dir, scratch, max(args.concurrency))]
                else:
                    targets += [RawTarget(model_dir), ServerTarget(model_dir, scratch, max(args.concurrency))]
            targets += exo
            rows = [row for target in targets for row in run_target(target, cells, args, nonce)]
    found = ratios(rows)
    print_table(rows, found)
    if args.json is not None:
        report = {
            "model": args.model,
            "model_dir": str(args.model_dir)
            if args.model_dir
            else f"random llama hidden={args.hidden} layers={args.layers} context={args.context}",
            "machine": {"platform": platform.platform(), "device": str(mx.default_device())},
            "started_at": started,
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "api_key", "model_dir")},
            "results": rows,
            "ratios": found,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
