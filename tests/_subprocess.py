"""Running a test script in a fresh interpreter (a CUDA context a device assert poisons, a process started
after some import, ...) with the repository importable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# ``pip install -e ".[hf]"`` (the README's install) leaves torchao out; a ``None`` entry in ``sys.modules`` makes it
# unimportable, and unavailable to transformers' ``find_spec`` check, in an environment that has it
WITHOUT_TORCHAO = "import sys; sys.modules['torchao'] = None  # as the README's install leaves it\n"


def run_python(body: str, env_update: dict[str, str | None] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the dedented ``body`` with ``python -c``; ``env_update`` sets variables (``None`` removes one)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    for key, value in (env_update or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=env, capture_output=True, text=True,
                          timeout=timeout)
