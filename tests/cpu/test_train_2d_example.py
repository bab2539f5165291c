"""examples/train_2d.py on four emulated ranks (dp 2 x tp 2): its losses match the same steps run
unsharded in one process (the example prints both)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_2d_example_matches_unsharded(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, whatever the machine
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_2d.py"), "--steps", "2", "--seq", "8",
                           "--batch", "1", "--checkpoint", str(tmp_path / "checkpoint")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    differences = [float(v) for v in re.findall(r"^step \d+: reference loss .* difference ([0-9.e+-]+)",
                                                 proc.stdout, re.M)]
    assert len(differences) == 2 and max(differences) < 1e-5, proc.stdout
    assert "trained on 2 x 2 (dp x tp) ranks" in proc.stdout, proc.stdout
    assert (tmp_path / "checkpoint" / ".metadata").exists()
