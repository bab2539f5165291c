"""What the five ops share through their one base class: the policy words and the environment's
policy, the max_spin check, the settings' parsing, and the error words' reports."""

import pytest
import torch

from tileweave import AllGatherGemm, GemmAllReduce, GemmReduceScatter, MoEAllGatherGemm, MoEGemmReduceScatter
from tileweave.ops import common
from tileweave.ops.all_reduce import rule
from tileweave.ops.skeleton import PATHS, ErrorWords, TPOp
from tileweave.runtime import settings
from tileweave.runtime.backend import CollectiveTimeout, HostWord

OPS = (AllGatherGemm, GemmReduceScatter, GemmAllReduce, MoEAllGatherGemm, MoEGemmReduceScatter)


def test_the_five_ops_share_one_base_and_the_common_policy_words():
    for cls in OPS:
        assert issubclass(cls, TPOp), cls
        assert {"auto", "fused", "fallback"} <= set(cls.policies), cls
        assert cls().policy == "auto"


@pytest.mark.parametrize("cls", OPS)
def test_the_environment_policy_reaches_every_op_or_is_refused_by_name(monkeypatch, cls):
    monkeypatch.setenv(settings.POLICY, "fallback")
    assert cls().policy == "fallback"
    assert cls(policy="fused").policy == "fused"  # an explicit policy is kept
    monkeypatch.setenv(settings.POLICY, "oneshot")
    if "oneshot" in cls.policies:
        assert cls().policy == "oneshot"
    else:
        with pytest.raises(ValueError, match="policy must be one of .* got 'oneshot' \\(from TILEWEAVE_POLICY\\)"):
            cls()


@pytest.mark.parametrize("cls", OPS)
@pytest.mark.parametrize("bad", [0, -3, 1 << 31, 2.5, True, "7"])
def test_max_spin_is_checked_alike_by_every_op(cls, bad):
    with pytest.raises(ValueError, match=f"{cls.__name__}: max_spin is the polls"):
        cls(max_spin=bad)
    op = cls(max_spin=5)
    with pytest.raises(ValueError, match="max_spin"):
        op.max_spin = bad
    assert op.max_spin == 5


def test_settings_parse_and_name_the_variable(monkeypatch):
    monkeypatch.setenv(settings.TIMEOUT_S, "7.5")
    assert settings.number(settings.TIMEOUT_S, 120) == 7.5
    monkeypatch.setenv(settings.TIMEOUT_S, "soon")
    with pytest.raises(ValueError, match="TILEWEAVE_TIMEOUT_S='soon' is not a number"):
        settings.number(settings.TIMEOUT_S, 120)
    monkeypatch.setenv(settings.MAX_SPIN, "0")
    with pytest.raises(ValueError, match="TILEWEAVE_MAX_SPIN"):
        settings.max_spin(100)
    monkeypatch.delenv(settings.MAX_SPIN)
    assert settings.max_spin(100) == 100
    for value, expected in (("", None), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(settings.RS_PULL, value)
        assert settings.optional_flag(settings.RS_PULL) is expected


@pytest.mark.parametrize("cls", OPS)
def test_an_entry_points_override_reaches_the_ops_over_the_environment(monkeypatch, cls):
    # settings.override is how the CLI's --policy reaches the ops without writing os.environ.
    monkeypatch.setenv(settings.POLICY, "oneshot")
    settings.override(settings.POLICY, "fallback")
    try:
        assert cls().policy == "fallback"
    finally:
        settings.override(settings.POLICY, None)
    assert settings.text(settings.POLICY) == "oneshot"


class _Backend:
    rank, interpreter = 1, True

    def synchronize(self):
        pass


def test_a_host_word_raises_once_naming_the_rank_and_clears_both_words():
    words = ErrorWords("gemm_all_reduce")
    host, device_word = HostWord(torch.device("cpu")), torch.tensor([0], dtype=torch.int32)
    words.host(lambda: host, lambda: device_word)
    words.raise_pending(_Backend())  # nothing recorded: nothing raised
    host.tensor.fill_(300 + 3)
    device_word.fill_(300 + 3)
    with pytest.raises(CollectiveTimeout, match="gemm_all_reduce on rank 1: .*reduced rows of rank 3 expired"):
        words.raise_pending(_Backend())
    assert host.read() == 0 and int(device_word) == 0
    words.raise_pending(_Backend())  # reported once


@pytest.mark.parametrize("code, error, text", [(1 + 2, CollectiveTimeout, "the shard of rank 2"),
                                                (100 + 0, CollectiveTimeout, "the partials of rank 0"),
                                                (common.BAD_IDS + 5, ValueError, "5 expert id\\(s\\) outside")])
def test_a_watched_word_raises_at_once_on_the_cpu(code, error, text):
    words = ErrorWords("moe_all_gather_gemm")
    word = torch.tensor([code], dtype=torch.int32)
    with pytest.raises(error, match=text):
        words.watch("kernel", word, _Backend())
    assert int(word) == 0


def test_gemm_all_reduce_fused_policy_takes_the_faster_fused_transport():
    # The rule's worked examples (N = 8192, bf16, 132 SMs): two-shot at TP = 8, M = 256; one-shot at
    # TP = 2, where it always wins; never NCCL, even where NCCL is estimated faster.
    assert rule.fused_path(256, 8192, 8, 2, programs=132) == "twoshot"
    assert rule.fused_path(64, 8192, 2, 2, programs=132) == "oneshot"
    big = dict(m=16384, n=8192, world=8, itemsize=2, programs=132)
    assert rule.choose_path(**big, slot_bytes=2 << 30) == "fallback"
    assert rule.fused_path(**big) in ("oneshot", "twoshot")


def test_path_names_are_one_vocabulary():
    assert set(PATHS) == {"local", "fused", "chunked", "oneshot", "twoshot", "fallback"}
