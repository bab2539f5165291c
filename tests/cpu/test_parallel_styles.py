"""tileweave.parallel's styles under torch's parallelize_module on emulated ranks, against the same
modules unsharded in float64: outputs, input gradients and every parameter gradient."""

import pytest

from support import scenarios
from tileweave.testing.emulated import run_ranks


@pytest.mark.parametrize("layout, batch, paths, placements", [
    ("sequence", 2, "fused chunked None", "None"),           # Shard(1) of [B, S, H], B > 1: rank-major copies
    ("sequence", 1, "fused chunked None", "None"),           # B = 1: no copy
    ("dtensor", 2, "fused chunked None", "(Shard(dim=1),)"),
    ("replicate", 2, "None None oneshot", "None"),           # torch's default layouts: gemm_all_reduce
])
def test_mlp_styles_match_unsharded(layout, batch, paths, placements):
    for result in run_ranks(2, scenarios.styles_mlp_check, batch, 12, layout):
        assert result.pop("paths") == paths, result
        assert result.pop("placements") == placements, result
        assert len(result) == 6, result                     # y, dx and four parameter gradients
        for key, err in result.items():
            assert err < 1e-5, (key, result)


def test_llama_plan_matches_unsharded():
    # Embedding, norms, attention (GQA, RoPE), SwiGLU MLP and output of two blocks, batch 2.
    for result in run_ranks(2, scenarios.styles_llama_check, 2, 8):
        assert result.pop("paths") == "fused chunked", result
        assert len(result) == 1 + 21, result             # logits, 21 parameters
        for key, err in result.items():
            assert err < 1e-5, (key, result)


def test_styles_refuse_what_they_cannot_run():
    messages = run_ranks(2, scenarios.styles_refusals_check)[0]
    assert "parallelizes nn.Linear" in messages["conv"] and "got Conv1d" in messages["conv"], messages
    assert "got _MyLinear" in messages["subclass"], messages
    assert "out_features=7" in messages["uneven"] and "TP size 2" in messages["uneven"], messages
    assert "1-D mesh" in messages["mesh_2d"] and "(1, 2)" in messages["mesh_2d"], messages
    assert "sequence dimension 1" in messages["sequence"] and "(1, 3, 4)" in messages["sequence"], messages
    assert messages["even_ok"] == (1, 6, 2), messages


def test_uneven_local_sequence_shards_name_the_argument_on_every_rank():
    # Each rank's local shard has its own length: the fused op's agreement names the argument that
    # differs (it used to print two unlabelled tuples).
    for text in run_ranks(2, scenarios.styles.uneven_local_shards):
        assert text.startswith("TileweaveError: all_gather_gemm:") and "a_shard rows 3" in text \
            and "a_shard rows 2" in text, text
