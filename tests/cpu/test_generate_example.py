"""examples/generate.py on two emulated ranks: greedy tokens of the TP model equal the unsharded
reference's, and the speeds are printed; its check rejects tokens that differ."""

import importlib
import sys
from pathlib import Path

import pytest

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


@pytest.fixture(scope="module")
def example():
    """The example imported as the module ``generate``: its ranks import ``generate.generation_rank`` by
    name, from the ``sys.path`` they get from this process."""
    sys.path.insert(0, EXAMPLES)
    try:
        yield importlib.import_module("generate")
    finally:
        sys.path.remove(EXAMPLES)
        sys.modules.pop("generate", None)


def test_generate_example_tokens_match_reference(example, capsys):
    rc = example.main(["--world", "2", "--batch", "2", "--prompt-len", "4", "--new-tokens", "3", "--layers", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tokens match the unsharded reference" in out, out
    assert "prefill:" in out and "decode:" in out and "tokens/s" in out, out


def test_generate_example_check_rejects_other_tokens(example, capsys):
    args = example.parse_args(["--batch", "1", "--prompt-len", "2", "--new-tokens", "2", "--layers", "1",
                               "--hidden", "16", "--heads", "2", "--kv-heads", "2", "--ffn", "8", "--vocab", "8"])
    state, prompt = example.generation_inputs(example.config_of(args), 1, 2, args.seed)
    want = example.reference_generate(state, example.config_of(args), prompt, 2).tolist()
    wrong = [[(t + 1) % 8 for t in want[0]]]
    ok = {"tokens": want, "prefill_s": 1.0, "decode_s": 1.0}
    assert example.report(args, [ok, ok], 2, "test") == 0
    assert example.report(args, [ok, {**ok, "tokens": wrong}], 2, "test") == 1
    assert "MISMATCH on ranks [1]" in capsys.readouterr().out
