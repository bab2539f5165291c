"""examples/train_moe.py on two emulated ranks: it trains (the loss goes down) and reports tokens/s."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_moe_example_loss_goes_down():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, whatever the machine
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), "--steps", "2", "--layers", "1",
                           "--tokens", "16", "--lr", "1e-2"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(v) for v in re.findall(r"^step \d+: loss ([0-9.]+)", proc.stdout, re.M)]
    assert len(losses) == 2, proc.stdout
    assert losses[-1] < 0.98 * losses[0], losses
    assert re.search(r"median [0-9,]+ tokens/s over steps 2\.\.2 \(2 ranks\)", proc.stdout), proc.stdout
