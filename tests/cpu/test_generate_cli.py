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
