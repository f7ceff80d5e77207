"""A tiny run (configs/tiny.yaml) trained once per test session by the real script, shared by the modules
that import it (test_api.py, test_server.py): a plain module cache, so conftest.py stays untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

_RUN: dict[str, Path] = {}


def tiny_run(tmp_path_factory) -> Path:
    """The run directory of a tiny model trained by train_transformer.py (about 10 s on one core)."""
    if "run" not in _RUN:
        root = tmp_path_factory.mktemp("tiny_run")
        proc = subprocess.run([sys.executable, str(ROOT / "train_transformer.py"), "--config", "configs/tiny.yaml",
                               f"train.out_dir={root / 'run'}", f"data.prepared_dir={root / 'prepared'}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "NMT_DEBUG": "0"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        _RUN["run"] = root / "run"
    return _RUN["run"]
