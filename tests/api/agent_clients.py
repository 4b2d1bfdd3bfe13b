"""Claude Code's and opencode's default requests (their own system prompts and tools)
against a real node: a model whose context is too small refuses them at once with the
context-length error, a large enough one serves them. Not a pytest module (prefilling the
agents' prompts takes minutes on a CPU): run it by hand,

    .venv/bin/python -m tests.api.agent_clients [WORKDIR]

It installs both clients from npm into WORKDIR, serves scripted qwen3 models of 4k, 32k
and 400k tokens of context, runs each client once against a too-small and a large enough
model, and prints the node's log line for each request."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from exo.devtools.scripted_families import PLAIN_SCRIPT
from exo.devtools.scripted_models import make_scripted_model
from tests.support.node import ExoNode, start_node, stop_node

CONTEXTS = {"scripted/qwen3-4k": 4096, "scripted/qwen3-32k": 32768, "scripted/qwen3-400k": 400_000}
CLIENTS = ("@anthropic-ai/claude-code", "opencode-ai")
# A refused client retries or compacts for a while; one that is served prefills for minutes
# (opencode 1.18 sends 26,909 tokens: 658 s at ~41 tok/s on a 2-core CPU).
REFUSED_TIMEOUT, SERVED_TIMEOUT = 120, 1200


def install_clients(work: Path) -> Path:
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(work), *CLIENTS], check=True)
    # npm leaves their postinstall scripts (which fetch each client's native binary) unrun.
    subprocess.run(["node", "install.cjs"], cwd=work / "node_modules/@anthropic-ai/claude-code", check=True)
    subprocess.run(["node", "postinstall.mjs"], cwd=work / "node_modules/opencode-ai", check=True)
    return work / "node_modules/.bin"


def serve(work: Path) -> ExoNode:
    models = work / "models"
    for model, context in CONTEXTS.items():
        model_dir = make_scripted_model(models / model.replace("/", "--"), "qwen3", PLAIN_SCRIPT.script)
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    node = start_node(work / "home", {"EXO_MODELS_DIRS": str(models)})
    for model in CONTEXTS:
        node.place(model)
    return node


def run_claude(bin_dir: Path, node: ExoNode, model: str, home: Path, timeout: float) -> None:
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": node.url,
        "ANTHROPIC_API_KEY": "unused",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    home.mkdir(parents=True, exist_ok=True)
    command = [str(bin_dir / "claude"), "-p", "hello", "--model", model]
    _run(command, env, home, timeout)


def run_opencode(bin_dir: Path, node: ExoNode, model: str, home: Path, timeout: float) -> None:
    config_dir = home / ".config/opencode"
    config_dir.mkdir(parents=True, exist_ok=True)
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "exo",
        "options": {"baseURL": f"{node.url}/v1", "apiKey": "unused"},
        "models": {name: {"name": name} for name in CONTEXTS},
    }
    (config_dir / "opencode.json").write_text(json.dumps({"provider": {"exo": provider}}))
    command = [str(bin_dir / "opencode"), "run", "-m", f"exo/{model}", "hello"]
    _run(command, {**os.environ, "HOME": str(home)}, home, timeout)


def _run(command: list[str], env: dict[str, str], cwd: Path, timeout: float) -> None:
    print(f"$ {' '.join(command[1:])}", flush=True)
    try:
        done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        print(f"exit {done.returncode}: {(done.stdout + done.stderr).strip()[-600:]}", flush=True)
    except subprocess.TimeoutExpired:
        print(f"no exit within {timeout} s", flush=True)


def request_lines(node: ExoNode) -> list[str]:
    return [
        line.split(" - ", 1)[-1] for line in node.logs().splitlines() if "/v1/messages " in line or "/v1/chat" in line
    ]


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="agent_clients_"))
    bin_dir = install_clients(work)
    node = serve(work)
    try:
        run_claude(bin_dir, node, "scripted/qwen3-32k", work / "claude-small", REFUSED_TIMEOUT)
        run_opencode(bin_dir, node, "scripted/qwen3-4k", work / "opencode-small", REFUSED_TIMEOUT)
        run_opencode(bin_dir, node, "scripted/qwen3-32k", work / "opencode-large", SERVED_TIMEOUT)
        run_claude(bin_dir, node, "scripted/qwen3-400k", work / "claude-large", SERVED_TIMEOUT)
    finally:
        print("\n".join(request_lines(node)))
        stop_node(node)


if __name__ == "__main__":
    main()
