"""exo-bench end to end on a tiny random llama with tiny sizes: it starts its own node,
runs raw mlx-lm and mlx_lm.server beside it, and writes JSON whose rows say what was
measured: every cell of the sweep for every target, prompts of about the asked size,
exactly tg tokens each (EOS banned), a warm prompt found in the prefix cache, each
concurrent stream's text equal to its solo run's and to raw mlx-lm's."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PP, TG = 48, 6


def _command() -> list[str]:
    script = Path(sys.executable).parent / "exo-bench"
    # The console script once pyproject.toml's entry is installed, the module before.
    return (
        [str(script)]
        if script.exists() or shutil.which("exo-bench")
        else [sys.executable, "-m", "exo.devtools.exo_bench"]
    )


def _rate_or_burst(rate: float) -> bool:
    # NaN: a server streamed the few tokens of this tiny model after the first in one
    # event, so no decode rate can be measured from the client (bench_client.py).
    return math.isnan(rate) or rate > 0


def test_exo_bench_sweeps_every_target_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--pp", str(PP), "--tg", str(TG), "--concurrency", "1,2", "--prefix-cache", "on,off"]
    args += ["--rounds", "1", "--side-by-side", "--verify", "--hidden", "64", "--layers", "2", "--json", str(out)]
    args += ["--engine", "mlx"]  # its texts are compared with raw mlx-lm's
    run = subprocess.run(_command() + args, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "agg tok/s" in run.stdout  # the table

    report = json.loads(out.read_text())
    rows = {(r["target"], r["concurrency"], r["prefix_cache"]): r for r in report["results"]}
    # Raw mlx-lm keeps no cache between calls: it has no prefix-cache-on cells.
    expected = {("mlx-lm", c, "off") for c in (1, 2)}
    expected |= {(t, c, p) for t in ("mlx_lm.server", "exo single") for c in (1, 2) for p in ("on", "off")}
    assert set(rows) == expected
    for key, row in rows.items():
        assert abs(row["prompt_tokens"] - PP) <= PP // 4, (key, row["prompt_tokens"])
        assert row["completion_tokens"] == TG, key
        assert len(row["texts"]) == key[1] and _rate_or_burst(row["aggregate_tps"]) and row["ttft_s"] > 0
        # End to end: every token over the round's whole time, first request sent to last token.
        assert row["end_to_end_tps"] > 0 and row["ttft_max_s"] > 0, key
        if key[1] > 1:
            assert row["identical_to_solo"] is True, key
        if key[2] == "on":
            assert row["warm_equals_cold"] is True, key
    assert rows["exo single", 1, "on"]["cached_tokens"] >= PP * 0.8
    assert rows["exo single", 1, "off"]["texts"] == rows["mlx-lm", 1, "off"]["texts"]
    whats = {entry["what"] for entry in report["ratios"]}
    assert {"exo single vs mlx-lm (aggregate)", "exo single: 2 streams vs 1 (aggregate)"} <= whats
    assert {"exo single: TTFT prefix off / on", "mlx_lm.server vs mlx-lm (aggregate)"} <= whats
    assert "exo single vs mlx-lm (end to end)" in whats
    # The runner's peak held its weights and the largest cell's KV at least.
    [memory] = [e for e in report["ratios"] if e["what"] == "exo single: peak memory / (weights + the requests' KV)"]
    assert memory["ratio"] >= 1.0 and memory["cell"].startswith(f"pp={PP} tg={TG} c=2")


def test_exo_bench_side_by_side_on_llama_cpp_runs_raw_llama_cpp(tmp_path):
    """With llama.cpp nodes the raw target is llama.cpp itself on exo's GGUF of the same
    dir: exo's texts equal its, one stream and two."""
    out = tmp_path / "bench.json"
    args = ["--pp", str(PP), "--tg", str(TG), "--concurrency", "1,2", "--rounds", "1", "--side-by-side"]
    args += ["--hidden", "64", "--layers", "2", "--engine", "llamacpp", "--json", str(out)]
    run = subprocess.run(_command() + args, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["target"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(t, c) for t in ("llama.cpp", "exo single") for c in (1, 2)}
    for key, row in rows.items():
        assert row["completion_tokens"] == TG and _rate_or_burst(row["aggregate_tps"]), key
    for concurrency in (1, 2):
        assert rows["exo single", concurrency]["texts"] == rows["llama.cpp", concurrency]["texts"]
    whats = {entry["what"] for entry in report["ratios"]}
    assert {"exo single vs llama.cpp (aggregate)", "llama.cpp: 2 streams vs 1 (aggregate)"} <= whats


def test_a_disaggregated_bench_runs_every_placement_on_mlx():
    """Only MLX hands KV over, so the nodes alone it is compared with run MLX too (a Linux
    node's default, llama.cpp, made the prefill node alone look 1.8x faster)."""
    from exo.devtools.exo_bench import parse_args

    placements = ["--placements", "decode-node,prefill-node,disaggregated"]
    assert parse_args(placements).engine == "mlx"
    assert parse_args(["--placements", "single"]).engine is None
    with pytest.raises(SystemExit):
        parse_args([*placements, "--engine", "llamacpp"])
