"""The benchmark suite: filters, per-rank shapes, the deduplicated single-GPU GEMM list."""

from __future__ import annotations

import pytest

from tileweave.bench.suite import (
    M_VALUES,
    SUITE_LAYERS,
    gemm_shapes,
    local_shapes,
    match_layers,
    parse_ints,
    parse_ops,
    select_rows,
)


def by_name(name: str):
    return next(ly for ly in SUITE_LAYERS if ly.name == name)


def test_suite_is_the_design_table():
    assert len(SUITE_LAYERS) == 10
    assert sum(ly.kind == "AG" for ly in SUITE_LAYERS) == 5
    assert by_name("gpt3-175b fc2").k == 49152 and by_name("gpt3-175b fc2").n == 12288
    assert M_VALUES == (1024, 2048, 4096, 8192, 16384)


@pytest.mark.parametrize(
    "filters, expected",
    [
        (["llama3-8b qkv"], ["llama3-8b qkv"]),
        (["LLAMA3-8B_QKV"], ["llama3-8b qkv"]),
        (["llama3-70b"], ["llama3-70b qkv", "llama3-70b gate_up", "llama3-70b o", "llama3-70b down"]),
        (["qkv"], ["llama3-8b qkv", "llama3-70b qkv"]),
        (["gate up"], ["llama3-8b gate_up", "llama3-70b gate_up"]),
        # Suite order and no duplicates, whatever the filter order.
        (["gpt3-175b fc1", "llama3-8b qkv", "qkv"], ["llama3-8b qkv", "llama3-70b qkv", "gpt3-175b fc1"]),
        (None, [ly.name for ly in SUITE_LAYERS]),
    ],
)
def test_match_layers(filters, expected):
    assert [ly.name for ly in match_layers(filters)] == expected


def test_unknown_layer_names_the_choices():
    with pytest.raises(ValueError, match="matches no layer.*llama3-8b qkv"):
        match_layers(["llama4"])


def test_select_rows_filters_kind_layer_and_m():
    rows = select_rows(kind="RS", layers=["llama3-8b", "qkv"], m_values=[4096, 1024], world_size=2)
    assert [(r.layer.name, r.m) for r in rows] == [
        ("llama3-8b o", 4096), ("llama3-8b o", 1024), ("llama3-8b down", 4096), ("llama3-8b down", 1024),
    ]
    every = select_rows(kind="AG", world_size=8)
    assert len(every) == 5 * len(M_VALUES)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("layer", SUITE_LAYERS, ids=lambda ly: ly.name)
def test_local_shapes_multiply_back_to_the_layer(layer, world):
    m = 4096
    s = local_shapes(layer, m=m, world_size=world)
    if layer.kind == "AG":
        # Gathering the row shards gives the full input; the weight's column shards give N.
        assert (s.a[0] * world, s.a[1]) == (m, layer.k)
        assert (s.w[0] * world, s.w[1]) == (layer.n, layer.k)
        assert s.out == (m, layer.n // world)
        assert (s.gemm_m, s.gemm_k, s.gemm_n) == (m, layer.k, layer.n // world)
    else:
        # Summing the K shards gives the full product; scattering rows splits the output.
        assert (s.a[0], s.a[1] * world) == (m, layer.k)
        assert (s.w[0], s.w[1] * world) == (layer.n, layer.k)
        assert (s.out[0] * world, s.out[1]) == (m, layer.n)
        assert (s.gemm_m, s.gemm_k, s.gemm_n) == (m, layer.k // world, layer.n)
    assert s.gemm_flops * world == 2 * m * layer.k * layer.n


def test_uneven_shard_is_an_error_naming_the_dim():
    with pytest.raises(ValueError, match="M=1000 is not divisible by world_size=3"):
        local_shapes(by_name("llama3-8b qkv"), m=1000, world_size=3)
    with pytest.raises(ValueError, match="K=4096 is not divisible by world_size=3"):
        local_shapes(by_name("llama3-8b o"), m=3 * 1024, world_size=3)
    with pytest.raises(ValueError, match="divisible"):
        select_rows(kind="AG", m_values=[1000], world_size=3)


def test_gemm_shapes_cover_both_tp_sizes_and_dedupe():
    shapes = gemm_shapes(layers=["llama3-8b o"], m_values=[2048])
    o = by_name("llama3-8b o")
    assert {(s.m, s.n, s.k) for s in shapes} == {(2048, o.n, o.k // 2), (2048, o.n, o.k // 8)}
    assert shapes[0].flops == 2 * 2048 * o.n * (o.k // 2)

    # The same TP size twice yields every shape twice: they collapse to one with two sources.
    once = gemm_shapes(m_values=[1024], tp_sizes=(2,))
    twice = gemm_shapes(m_values=[1024], tp_sizes=(2, 2))
    assert [(s.m, s.n, s.k) for s in twice] == [(s.m, s.n, s.k) for s in once]
    assert all(len(s.sources) == 2 for s in twice)
    assert twice[0].label.endswith("(+1)")

    full = gemm_shapes()
    keys = [(s.m, s.n, s.k) for s in full]
    assert len(keys) == len(set(keys))
    assert sum(len(s.sources) for s in full) == len(SUITE_LAYERS) * len(M_VALUES) * 2


def test_parse_ops_and_ints():
    assert parse_ops("rs, gemm") == ("gemm", "rs")
    with pytest.raises(ValueError, match="--op"):
        parse_ops("ag,allreduce")
    assert parse_ints("1024,2048", name="--m") == (1024, 2048)
    with pytest.raises(ValueError, match="--m expects"):
        parse_ints("1k", name="--m")


def test_design_table_shapes_are_selectable_but_not_default():
    from tileweave.bench.suite import BASELINE_LAYERS, SUITE_LAYERS, select_rows

    default = select_rows(kind="AG", world_size=2)
    assert {r.layer for r in default} <= set(SUITE_LAYERS)
    chosen = select_rows(kind="RS", layers=["design-table"], m_values=[8192], world_size=2)
    assert {r.layer for r in chosen} == {ly for ly in BASELINE_LAYERS if ly.kind == "RS"}
    assert {(r.layer.k, r.layer.n) for r in chosen} >= {(12288, 49152), (8192, 8192)}
