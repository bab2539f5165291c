"""The ``tileweave`` command: help, version, subcommand help in plain text, bad options without a
traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import tileweave
from tileweave import cli

ROOT = Path(__file__).resolve().parents[2]
MARKUP = re.compile(r"``|:\w+:`|\*\*|^\s*\.\. ", re.M)
"""reStructuredText in what a terminal shows: literal quotes, roles, bold, directives."""


def test_help_lists_every_subcommand(capsys):
    for flag in ("--help", "-h", "help"):
        assert cli.main([flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: tileweave")
        for name in ("bench", "demo", "generate", "tune"):
            assert re.search(rf"^  {name}\s+\S", out, re.M), out
        assert "--version" in out and not MARKUP.search(out), out


def test_version_is_the_package_version(capsys):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"tileweave {project['version']}\n" == f"tileweave {tileweave.__version__}\n"


def test_the_installed_command_is_this_cli():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["tileweave"].partition(":")
    assert (module, name) == ("tileweave.cli", "main") and getattr(cli, name) is cli.main


@pytest.mark.parametrize("command", ["bench", "demo", "generate", "tune"])
def test_subcommand_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tileweave {command}") and not MARKUP.search(out), out


def test_an_unknown_subcommand_is_refused(capsys):
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'frobnicate'" in err and "bench, demo, generate, tune" in err


@pytest.mark.parametrize("value", ["0", "-1", "two", "17"])
def test_demo_refuses_bad_world_sizes_in_plain_words(value, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--world-size", value])
    assert done.value.code == 2
    assert "argument --world-size: expected" in capsys.readouterr().err


def test_a_bad_option_ends_without_a_traceback():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "tileweave", "demo", "--world-size", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr and "--world-size: expected between 1 and 16 ranks, got 0" in done.stderr


def test_the_cpu_main_job_checks_every_op_family():
    # The demo that scripts/main.sh runs without GPUs: each family's check passes (the checks compare
    # against float64 references inside the demo) and the exit code says so.
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "tileweave", "demo"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done
    for family in ("all_gather_gemm", "gemm_reduce_scatter", "moe pair", "gemm_all_reduce+norm"):
        line = next(line for line in done.stdout.splitlines() if line.strip().startswith(family))
        assert " OK " in line and "FAILED" not in line, line


def test_help_texts_are_whole_and_name_every_family():
    # demo --help used to stop mid-sentence (the docstring's first line); generate's help and the
    # Hugging Face example named four of the families the loader reads.
    import re
    from pathlib import Path

    from tileweave import demo, generate
    from tileweave.models.config import FAMILIES

    import contextlib
    import io

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        demo.main(["--help"])
    assert "with residual and RMSNorm." in " ".join(shown.getvalue().split())
    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "mixtral": "Mixtral",
             "qwen3_moe": "Qwen3-MoE"}
    assert set(names) == set(FAMILIES)
    example = (Path(__file__).resolve().parents[2] / "examples" / "hf_generate.py").read_text()
    for text in (generate.__doc__, example):
        flat = " ".join(text.split())
        for name in names.values():
            assert re.search(rf"\b{re.escape(name)}\b", flat), name
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "`generate`" in readme.split("lists the subcommands")[1].split("\n")[0]
