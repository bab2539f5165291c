"""The README's CPU quickstart is examples/quickstart_cpu.py, and it runs: two emulated ranks, fused
all-gather GEMM results against torch's product of the full inputs."""

import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_block(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_readme_cpu_quickstart_is_the_example():
    example = (ROOT / "examples" / "quickstart_cpu.py").read_text()
    body = example.split('"""', 2)[2].lstrip("\n")  # without the module docstring
    assert _readme_block("## Quickstart on the CPU") == body


def test_cpu_quickstart_runs(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["quickstart_cpu.py"])
    runpy.run_path(str(ROOT / "examples" / "quickstart_cpu.py"), run_name="__main__")
    errors = [float(v) for v in re.findall(r"[0-9.e+-]+", capsys.readouterr().out.strip().strip("[]"))]
    assert len(errors) == 2 and all(e < 1e-5 for e in errors), errors
