"""``tileweave generate`` on emulated CPU ranks: a tiny Hugging Face model written with ``transformers``,
split over three ranks, generates what ``transformers`` generates from it (greedy)."""

import pytest
import torch

from support import hf_models
from tileweave import cli

pytest.importorskip("transformers")


@pytest.mark.parametrize("family, tp", [("mistral", 3)])
def test_generate_command_matches_transformers(tmp_path, capsys, family, tp):
    model = hf_models.make_model(family, str(tmp_path))
    prompt = [5, 17, 3, 42, 8]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    code = cli.main(["generate", "--model", str(tmp_path), "--prompt-ids", ",".join(map(str, prompt)),
                     "--tp", str(tp), "--new-tokens", "4", "--progress"])
    captured = capsys.readouterr()
    assert code == 0, captured
    assert f"TP={tp}" in captured.out and "tokens/s" in captured.out, captured.out
    assert captured.out.strip().splitlines()[-1] == "tokens: " + ",".join(map(str, want)), captured.out


def test_generate_refuses_bad_options(tmp_path, capsys):
    for argv, text in ((["--model", str(tmp_path), "--prompt-ids", "1,2"], "has no config.json"),
                       (["--model", str(tmp_path), "--prompt-ids", "a,b"], "comma-separated token ids"),
                       (["--model", str(tmp_path), "--prompt-ids", "1", "--new-tokens", "0"], "--new-tokens")):
        with pytest.raises(SystemExit) as done:
            cli.main(["generate", *argv])
        assert done.value.code == 2 and text in capsys.readouterr().err


def test_generate_refuses_a_config_or_prompt_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    import json

    from tileweave import generate

    monkeypatch.setattr(generate, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 16}
    for changes, argv, text in (({"model_type": "gpt2"}, ["--prompt-ids", "1,2"], "model_type='gpt2' is not supported"),
                                ({}, ["--prompt-ids", "1,64"], "id 64 is outside the model's vocabulary of 64"),
                                ({}, ["--prompt-ids", "1,2", "--new-tokens", "15"], "exceed the model's max_seq=16")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(SystemExit) as done:
            cli.main(["generate", "--model", str(tmp_path), "--tp", "2", *argv])
        assert done.value.code == 2 and text in capsys.readouterr().err


def test_a_failure_in_the_ranks_is_one_line_unless_debug(tmp_path, capsys, monkeypatch):
    from tileweave import generate
    from tileweave.testing.emulated import RankFailed

    def fail(*args, **kwargs):
        raise RankFailed("rank 0:\nTraceback (most recent call last):\n  File x\nValueError: broken shard\n"
                         "rank 1:\nTraceback (most recent call last):\n  File x\nValueError: broken shard",
                         "ranks 0, 1: ValueError: broken shard")

    hf_models.make_model("llama", str(tmp_path))
    capsys.readouterr()  # the checkpoint writer's progress
    monkeypatch.setattr(generate, "run_ranks", fail)
    argv = ["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--tp", "2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tileweave generate: RankFailed: ranks 0, 1: ValueError: broken shard (--debug shows the "
                   "traceback)"], err
    with pytest.raises(RankFailed):
        cli.main(argv + ["--debug"])
