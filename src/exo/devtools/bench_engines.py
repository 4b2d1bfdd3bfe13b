"""Candidate engines for a CPU node, side by side in one run, on the same weights.

    python -m exo.devtools.bench_engines [--hidden 1024 --layers 16 --vocab 32000]
        [--prompt 512 --decode 128 --rounds 2 --threads 2] [--workdir DIR] [--only NAME,...]

Makes a random llama (bf16, HF layout; mlx-lm's llama and transformers' read the same
files), derives every format the engines take from it: mlx-lm's 4- and 8-bit affine
checkpoints, exo's GGUF conversions of those (Q4_K with the codes kept, Q4_1 bit for
bit, Q8_0 requantized: engine/llamacpp/gguf_convert.py) and llama.cpp's own Q8_0 / Q4_0 / Q4_1 (its quantizer,
from the BF16 GGUF). Then each engine runs in a subprocess of its own, `--rounds` times
alternating: load, prefill `--prompt` random tokens, decode `--decode` tokens after them
(fed, not sampled, so every engine does the same work), reporting load time, prefill and
decode tokens/s and the process's peak RSS; the best round counts, and the decode
ratios at the same bits also compare the median rounds. The machine's memory bandwidth
is a `--threads`-thread f32 matvec in torch (also a plain sum, which reads faster), and
each decode is also given as bytes of weights read per second (the token embedding left
out: a step reads one row of it) over each.

The engines: llama.cpp through llama-cpp-python (`--threads` threads; without its extra
buffer types unless EXO_BENCH_EXTRA_BUFTS=1, see _without_extra_buffers), MLX through
mlx-lm's raw generate_step, torch through transformers (bf16, f32, and int8 dynamic
quantization of the Linear layers, torch's own weight-only-int8 CPU path)."""

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Variant:
    name: str
    engine: str  # llamacpp, mlx, torch
    model: str  # a file or dir under the workdir
    weight_bytes_of: str  # what the decode reads per token (file or dir)
    option: str = ""
    bytes_factor: float = 1.0  # torch reads the bf16 files as f32 (2x) or int8 (0.5x)


VARIANTS = [
    Variant("llama.cpp Q8_0 (llama.cpp quantizer)", "llamacpp", "q8_0.gguf", "q8_0.gguf"),
    Variant("llama.cpp Q4_0 (llama.cpp quantizer)", "llamacpp", "q4_0.gguf", "q4_0.gguf"),
    Variant("llama.cpp Q4_1 (llama.cpp quantizer)", "llamacpp", "q4_1.gguf", "q4_1.gguf"),
    Variant("llama.cpp Q4_K (exo, from MLX 4-bit)", "llamacpp", "mlx-q4.gguf", "mlx-q4.gguf"),
    Variant("llama.cpp Q4_1 (exo, from MLX 4-bit, exact)", "llamacpp", "mlx-q4-exact.gguf", "mlx-q4-exact.gguf"),
    Variant("llama.cpp Q8_0 (exo, from MLX 8-bit)", "llamacpp", "mlx-q8.gguf", "mlx-q8.gguf"),
    Variant("MLX 8-bit (mlx-lm generate_step)", "mlx", "mlx-q8", "mlx-q8"),
    Variant("MLX 4-bit (mlx-lm generate_step)", "mlx", "mlx-q4", "mlx-q4"),
    Variant("torch bf16 (transformers)", "torch", "hf", "hf", "bf16"),
    Variant("torch f32 (transformers)", "torch", "hf", "hf", "f32", 2.0),
    Variant("torch int8 dynamic (transformers)", "torch", "hf", "hf", "int8", 0.5),
    # exo's own API on its default Linux engine, serving the MLX checkpoints (it converts
    # them to GGUF itself, as for any card): what a user of exo gets.
    Variant("exo API, llama.cpp engine (MLX 8-bit)", "exo", "mlx-q8", "mlx-q8.gguf"),
    Variant("exo API, llama.cpp engine (MLX 4-bit)", "exo", "mlx-q4", "mlx-q4.gguf"),
]

# Each exo variant against the llama.cpp variant at the same bits.
SAME_BITS = {
    "exo API, llama.cpp engine (MLX 8-bit)": "llama.cpp Q8_0 (llama.cpp quantizer)",
    "exo API, llama.cpp engine (MLX 4-bit)": "llama.cpp Q4_0 (llama.cpp quantizer)",
}


# --- the weights -----------------------------------------------------------------------


def _make_models(work: Path, hidden: int, layers: int, vocab: int) -> None:
    import mlx.core as mx
    from mlx_lm import convert

    from exo.devtools.tiny_models import make_tiny_model
    from exo.engine.llamacpp.gguf_convert import convert as to_gguf

    hf = work / "hf"
    if not (hf / "config.json").exists():
        config = {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": hidden // 64,
            "num_key_value_heads": hidden // 128,
            "intermediate_size": hidden * 11 // 4 // 256 * 256,
            "vocab_size": vocab,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "bos_token_id": 0,
            "eos_token_id": 1,
        }
        make_tiny_model(hf, "llama", config, dtype=mx.bfloat16, perturb_constants=False, pad_vocab_to_multiple_of=vocab)
    for bits in (4, 8):
        if not (work / f"mlx-q{bits}").exists():
            convert(str(hf), str(work / f"mlx-q{bits}"), quantize=True, q_bits=bits, q_group_size=64)
        if not (work / f"mlx-q{bits}.gguf").exists():
            to_gguf(work / f"mlx-q{bits}", work / f"mlx-q{bits}.gguf")
    if not (work / "mlx-q4-exact.gguf").exists():
        os.environ["EXO_GGUF_EXACT_Q4"] = "1"
        to_gguf(work / "mlx-q4", work / "mlx-q4-exact.gguf")
        del os.environ["EXO_GGUF_EXACT_Q4"]
    if not (work / "bf16.gguf").exists():
        to_gguf(hf, work / "bf16.gguf")
    for kind in ("q8_0", "q4_0", "q4_1"):
        if not (work / f"{kind}.gguf").exists():
            _llama_quantize(work / "bf16.gguf", work / f"{kind}.gguf", kind)


def _llama_quantize(source: Path, out: Path, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
                    "q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1}[kind]  # fmt: skip
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.pointer(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind}")


def _bytes_of(path: Path) -> int:
    """What a decode step reads: the weights, less a GGUF's token embedding when the
    model has a separate output matrix (a step reads one row of it)."""
    if path.is_file():
        from gguf import GGUFReader

        tensors = {t.name: t for t in GGUFReader(path).tensors}
        embedding = tensors["token_embd.weight"].n_bytes if "output.weight" in tensors else 0
        return path.stat().st_size - int(embedding)
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _q8_errors(work: Path) -> str:
    """How far MLX 8-bit, its Q8_0 conversion and llama.cpp's own Q8_0 are from the bf16
    weights, as RMS error over RMS weight, on layer 0's matrices."""
    from gguf import GGUFReader, dequantize

    from exo.engine.llamacpp.gguf_tensors import Affine, dequantize_affine, read_safetensors

    original = read_safetensors(sorted((work / "hf").glob("*.safetensors")))
    mlx = read_safetensors(sorted((work / "mlx-q8").glob("*.safetensors")))
    ours = {t.name: t for t in GGUFReader(work / "mlx-q8.gguf").tensors}
    theirs = {t.name: t for t in GGUFReader(work / "q8_0.gguf").tensors}
    errors: dict[str, list[float]] = {"mlx8": [], "mlx8->q8_0": [], "q8_0": [], "mlx8->q8_0 vs mlx8": []}
    for hf_name, gguf_name in (
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.down_proj", "ffn_down"),
        ("self_attn.o_proj", "attn_output"),
    ):
        base = f"model.layers.0.{hf_name}"
        w = original[base + ".weight"].as_float32()
        q = Affine(
            mlx[base + ".weight"].raw(), mlx[base + ".scales"].as_float32(), mlx[base + ".biases"].as_float32(), 8, 64
        )
        m8 = dequantize_affine(q)
        ours_w = dequantize(
            ours[f"blk.0.{gguf_name}.weight"].data, ours[f"blk.0.{gguf_name}.weight"].tensor_type
        ).reshape(w.shape)
        theirs_w = dequantize(
            theirs[f"blk.0.{gguf_name}.weight"].data, theirs[f"blk.0.{gguf_name}.weight"].tensor_type
        ).reshape(w.shape)
        rms = float(np.sqrt((w**2).mean()))
        for key, got, ref in (
            ("mlx8", m8, w),
            ("mlx8->q8_0", ours_w, w),
            ("q8_0", theirs_w, w),
            ("mlx8->q8_0 vs mlx8", ours_w, m8),
        ):
            errors[key].append(float(np.sqrt(((got - ref) ** 2).mean())) / rms)
    return ", ".join(f"{k} {np.mean(v):.2e}" for k, v in errors.items())


# --- one engine, in its own process ----------------------------------------------------


@dataclass
class Timing:
    load_s: float
    prefill_s: float
    decode_s: float


def _without_extra_buffers() -> None:
    """llama.cpp's models load without its extra CPU buffer types (the AMX and repacked
    layouts): a -march=native build, as a plain `pip install llama-cpp-python` makes,
    puts quantized weights in the AMX buffer, whose matmul segfaulted on a Sapphire
    Rapids VM (llama.cpp issue 20824)."""
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params() -> low.llama_model_params:
        value = default()
        value.use_extra_bufts = False
        return value

    low.llama_model_default_params = params


def _run_llamacpp(model: Path, prompt: list[int], fed: list[int], threads: int) -> Timing:
    import llama_cpp

    if os.environ.get("EXO_BENCH_EXTRA_BUFTS") != "1":
        _without_extra_buffers()
    start = time.perf_counter()
    llm = llama_cpp.Llama(
        str(model), n_ctx=len(prompt) + len(fed) + 16, n_batch=len(prompt), n_ubatch=len(prompt),
        n_threads=threads, n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    llm.eval(prompt[:8])  # first touch of the weights, as a warm-up would
    load_s = time.perf_counter() - start
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for token in fed:
        llm.eval([token])
    return Timing(load_s, prefill_s, time.perf_counter() - start)


def _run_mlx(model: Path, prompt: list[int], fed: list[int], threads: int) -> Timing:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    del threads  # MLX's CPU backend picks its own
    start = time.perf_counter()
    loaded = load(str(model))
    net = loaded[0]
    for _ in generate_step(mx.array(prompt[:8]), net, max_tokens=2):
        pass
    load_s = time.perf_counter() - start
    steps = generate_step(mx.array(prompt), net, max_tokens=len(fed) + 1, sampler=lambda x: mx.argmax(x, axis=-1))
    start = time.perf_counter()
    next(steps)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in steps:
        pass
    return Timing(load_s, prefill_s, time.perf_counter() - start)


def _run_torch(model: Path, prompt: list[int], fed: list[int], threads: int, option: str) -> Timing:
    import torch
    import transformers

    torch.set_num_threads(threads)
    start = time.perf_counter()
    dtype = torch.bfloat16 if option == "bf16" else torch.float32
    net = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    if option == "int8":
        net = torch.ao.quantization.quantize_dynamic(net, {torch.nn.Linear}, dtype=torch.qint8)
    with torch.inference_mode():
        net(torch.tensor([prompt[:8]]))
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        out = net(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        cache = out.past_key_values
        start = time.perf_counter()
        for token in fed:
            cache = net(torch.tensor([[token]]), past_key_values=cache, use_cache=True).past_key_values
    return Timing(load_s, prefill_s, time.perf_counter() - start)


def _run_exo(model: Path, prompt_len: int, decode: int) -> Timing:
    """One exo node started here on loopback with the llama.cpp engine, the model placed
    through the API; prefill is the time to the first streamed token of a ~prompt_len
    token chat prompt, decode the rate of the `decode` tokens streamed after it (EOS
    banned)."""
    from exo.devtools.bench_client import messages_for, words_for_tokens
    from exo.devtools.bench_targets import ExoTarget, loopback_nodes
    from exo.devtools.exo_bench import eos_ids

    with tempfile.TemporaryDirectory(prefix="exo-bench-engines-") as tmp:
        models = Path(tmp) / "models"
        models.mkdir()
        (models / f"bench--{model.name}").symlink_to(model.resolve())
        with loopback_nodes(1, Path(tmp), models, "llamacpp") as url:
            target = ExoTarget(url, f"bench/{model.name}", "single")
            start = time.perf_counter()
            target.open()
            load_s = time.perf_counter() - start
            banned = eos_ids(model)
            words = words_for_tokens(url, target.model, prompt_len)
            target.round([messages_for(words, "warmup")], 4, banned)
            best: Timing | None = None
            for index in range(2):
                measured = target.round([messages_for(words, f"m{index}")], decode + 1, banned).requests[0]
                # Scaled to exactly prompt_len and decode tokens, as the other engines run.
                prefill_s = measured.ttft * prompt_len / measured.prompt_tokens
                timing = Timing(load_s, prefill_s, decode / measured.decode_tps)
                best = timing if best is None or timing.decode_s < best.decode_s else best
            target.close()
            assert best is not None
            return best


def _child(variant: Variant, work: Path, prompt_len: int, decode: int, threads: int) -> None:
    rng = np.random.default_rng(0)
    vocab = json.loads((work / "hf" / "config.json").read_text())["vocab_size"]
    prompt = [int(t) for t in rng.integers(2, vocab, prompt_len)]
    fed = [int(t) for t in rng.integers(2, vocab, decode)]
    model = work / variant.model
    if variant.engine == "llamacpp":
        timing = _run_llamacpp(model, prompt, fed, threads)
    elif variant.engine == "mlx":
        timing = _run_mlx(model, prompt, fed, threads)
    elif variant.engine == "exo":
        os.environ["EXO_LLAMACPP_THREADS"] = str(threads)
        timing = _run_exo(model, prompt_len, decode)
    else:
        timing = _run_torch(model, prompt, fed, threads, variant.option)
    # exo's engine runs in the node's runner process, a descendant that has exited by now.
    who = resource.RUSAGE_CHILDREN if variant.engine == "exo" else resource.RUSAGE_SELF
    peak_mb = resource.getrusage(who).ru_maxrss / 1024
    print(json.dumps({**timing.__dict__, "peak_rss_mb": peak_mb}))


def _bandwidth_child(threads: int) -> None:
    """Two reads of 256 MiB, far past the caches, best of 12 each: an f32 matvec (what a
    decode step is, and issue 15's measure) and a plain sum (the higher read rate)."""
    import torch

    torch.set_num_threads(threads)
    matrix = torch.randn(8192, 8192)
    vector = torch.randn(8192)
    best = {"matvec": float("inf"), "sum": float("inf")}
    for _ in range(12):
        for name, read in (("matvec", lambda: torch.mv(matrix, vector)), ("sum", matrix.sum)):
            start = time.perf_counter()
            read()
            best[name] = min(best[name], time.perf_counter() - start)
    print(json.dumps({name: matrix.numel() * 4 / seconds / 1e9 for name, seconds in best.items()}))


# --- the run ---------------------------------------------------------------------------


def _in_child(args: list[str], realtime: bool) -> dict:
    command = [sys.executable, "-m", "exo.devtools.bench_engines", *args]
    out = subprocess.run(["chrt", "-f", "10", *command] if realtime else command, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rounds(variants: list[Variant], rounds: int, run: Callable[[Variant], dict]) -> Iterator[tuple[Variant, dict]]:
    for _ in range(rounds):
        for variant in variants:
            yield variant, run(variant)


def _median(results: list[dict], key: str) -> float | None:
    """The middle round's value: beside the best round, what a lucky round cannot move."""
    values = [r[key] for r in results if "error" not in r]
    return float(np.median(values)) if values else None


def _best(results: list[dict]) -> dict:
    good = [r for r in results if "error" not in r]
    if not good:
        return results[-1]
    return {
        "load_s": min(r["load_s"] for r in good),
        "prefill_s": min(r["prefill_s"] for r in good),
        "decode_s": min(r["decode_s"] for r in good),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in good),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--only", default="", help="comma-separated substrings of variant names")
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="run each engine under SCHED_FIFO (root): on a machine other work keeps busy, llama.cpp's spinning "
        "thread barriers otherwise wait out other processes' time slices (0.3 tok/s instead of 80 here)",
    )
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--bandwidth", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bandwidth:
        return _bandwidth_child(args.threads)
    work = args.workdir or Path(tempfile.gettempdir()) / f"exo-bench-engines-{args.hidden}x{args.layers}"
    if args.child:
        variant = next(v for v in VARIANTS if v.name == args.child)
        return _child(variant, work, args.prompt, args.decode, args.threads)

    work.mkdir(parents=True, exist_ok=True)
    _make_models(work, args.hidden, args.layers, args.vocab)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    variants = [v for v in VARIANTS if not wanted or any(w in v.name for w in wanted)]
    common = ["--workdir", str(work), "--prompt", str(args.prompt), "--decode", str(args.decode)]
    common += ["--threads", str(args.threads)]
    load_before = os.getloadavg()[0]
    probes = [_in_child(["--bandwidth", "--threads", str(args.threads)], args.realtime) for _ in range(2)]
    bandwidth = max(probe["matvec"] for probe in probes)
    read_rate = max(probe["sum"] for probe in probes)
    results: dict[str, list[dict]] = {}
    for variant, result in _rounds(
        variants, args.rounds, lambda v: _in_child(["--child", v.name, *common], args.realtime)
    ):
        results.setdefault(variant.name, []).append(result)
        print(f"  {variant.name}: {result}", file=sys.stderr, flush=True)

    params = json.loads((work / "hf" / "config.json").read_text())
    print(f"model: random llama, hidden {params['hidden_size']}, {params['num_hidden_layers']} layers, "
          f"vocab {params['vocab_size']}, bf16 {_bytes_of(work / 'hf') / 1e6:.0f} MB; threads {args.threads}; "
          f"prompt {args.prompt}, decode {args.decode}; best of {args.rounds}; realtime {args.realtime}; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")  # fmt: skip
    print(f"memory bandwidth ({args.threads}-thread f32 matvec): {bandwidth:.1f} GB/s; "
          f"a {args.threads}-thread sum reads {read_rate:.1f} GB/s")  # fmt: skip
    print(f"8-bit weight error, RMS error / RMS weight against bf16 (layer 0): {_q8_errors(work)}\n")
    print("| engine | MB read per token | load s | prefill tok/s | decode tok/s | decode GB/s | of matvec | of sum "
          "| peak RSS MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    rates: dict[str, tuple[float, float]] = {}
    for variant in variants:
        best = _best(results[variant.name])
        if "error" in best:
            print(f"| {variant.name} | failed: {best['error']} | | | | | | | |")
            continue
        size = _bytes_of(work / variant.weight_bytes_of) * variant.bytes_factor
        decode_tps = args.decode / best["decode_s"]
        rates[variant.name] = (args.prompt / best["prefill_s"], decode_tps)
        read = size * decode_tps / 1e9
        print(f"| {variant.name} | {size / 1e6:.0f} | {best['load_s']:.2f} | {args.prompt / best['prefill_s']:.0f} | "
              f"{decode_tps:.1f} | {read:.1f} | {read / bandwidth:.2f} | {read / read_rate:.2f} | "
              f"{best['peak_rss_mb']:.0f} |")  # fmt: skip
    for ours, theirs in SAME_BITS.items():
        if ours in rates and theirs in rates:
            ours_s, theirs_s = _median(results[ours], "decode_s"), _median(results[theirs], "decode_s")
            median = f" (median rounds {theirs_s / ours_s:.2f}x)" if ours_s and theirs_s else ""
            print(f"{ours} / {theirs}: decode {rates[ours][1] / rates[theirs][1]:.2f}x{median}, "
                  f"prefill {rates[ours][0] / rates[theirs][0]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
