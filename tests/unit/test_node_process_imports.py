"""The node process (API, master, worker) loads neither MLX nor torch: MLX belongs to
the runner processes, and transformers serves the node tokenizers only. Each would add
seconds to a node's start and memory it never uses. A fresh interpreter imports the
`exo` command's module, as starting a node does."""

import subprocess
import sys


def test_importing_the_node_loads_neither_mlx_nor_torch():
    probe = "import sys, exo.main; print(sorted(m for m in ('mlx.core', 'mlx_lm', 'torch') if sys.modules.get(m)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
