"""The real opencode client (npm's `opencode-ai`, pinned), installed once into a cache
(~/.cache/exo/npm/opencode-ai-<version>) and run offline: `opencode run` against a config
a test writes, with every startup fetch it would make (models.dev, updates, plugins, LSP
servers, sharing) turned off. scripts/setup.sh test installs it ahead of the tests:

    .venv/bin/python -m tests.support.opencode"""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

OPENCODE_VERSION = "1.18.33"
OFFLINE_ENV = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_CLAUDE_CODE": "1",
}
# A short system prompt, no tools and no title request: opencode's own (its agent prompt
# and ~20 tools' schemas, ~27k tokens) takes minutes to prefill on a CPU, and its title
# agent's prompt alone ~1,900 of the scripted models' tokens. Given apart from the config
# under test (opencode merges OPENCODE_CONFIG_CONTENT over the project's opencode.json),
# so that file stays exactly what the user copied.
QUICK_AGENT = {
    "agent": {"build": {"prompt": "You are a terse assistant."}, "title": {"disable": True}},
    "tools": {"*": False},
}


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "exo" / "npm" / f"opencode-ai-{OPENCODE_VERSION}"


def opencode_binary() -> Path:
    """The opencode executable, installed from npm into the cache the first time."""
    binary = cache_dir() / "node_modules" / ".bin" / "opencode"
    if binary.exists():
        return binary
    shutil.rmtree(cache_dir(), ignore_errors=True)  # a cache some other way left without its binary
    cache_dir().parent.mkdir(parents=True, exist_ok=True)
    # Installed next to the cache and renamed into place: an interrupted install leaves no
    # half-filled cache behind.
    staging = Path(tempfile.mkdtemp(prefix="opencode-", dir=cache_dir().parent))
    try:
        npm = ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(staging)]
        subprocess.run([*npm, f"opencode-ai@{OPENCODE_VERSION}"], check=True, capture_output=True)
        # npm leaves the postinstall unrun; it copies the platform's binary (an optional
        # dependency npm already fetched) into place, with no network.
        subprocess.run(["node", "postinstall.mjs"], cwd=staging / "node_modules/opencode-ai", check=True)
        staging.rename(cache_dir())
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return binary


def run_opencode(project: Path, model: str, prompt: str, *extra: str, timeout: float = 300) -> str:
    """`opencode run -m <model> <prompt>` in `project` (whose opencode.json the caller wrote),
    with a home of its own next to the project (where `--continue` finds the session
    before); returns what it printed. Fails on a nonzero exit."""
    home = project.with_name(f"{project.name}-home")
    home.mkdir(exist_ok=True)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OPENCODE", "XDG_"))},
        **OFFLINE_ENV,
        "HOME": str(home),
        # opencode takes its directory from $PWD, not the process's working directory.
        "PWD": str(project),
        "OPENCODE_CONFIG_CONTENT": json.dumps(QUICK_AGENT),
    }
    command = [str(opencode_binary()), "run", "-m", model, *extra, prompt]
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"opencode exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


if __name__ == "__main__":
    print(opencode_binary())
