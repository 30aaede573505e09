"""The out-of-sample evaluation's statistics on toy tables whose answers are known by hand,
and the new published rows as their sources give them."""

from __future__ import annotations

import re

import pytest
import torch

from tessera.plan import out_of_sample as oos
from tessera.plan.model_presets import PRESETS


def _row(layout: str, ranks: int, measured: float, predicted: float) -> dict:
    return {"layout": layout, "ranks": ranks, "measured_s": measured, "predicted_s": predicted}


def test_table_stats_counts_within_20pct_spearman_and_best_on_a_toy_table():
    rows = [
        _row("serial", 1, 10.0, 10.0),  # calibration: left out of every statistic
        _row("a", 2, 6.0, 6.6),  # +10%: within
        _row("b", 2, 5.0, 6.25),  # +25%: out
        _row("c", 4, 4.0, 3.0),  # -25%: out
        _row("d", 4, 3.0, 3.3),  # +10%: within
    ]
    stats = oos.table_stats(rows)
    assert stats["predicted"] == 4 and stats["within_20pct"] == 2
    assert [r["rel_error"] for r in rows[1:]] == [0.1, 0.25, -0.25, 0.1]
    # measured ranks a4 b3 c2 d1; predicted 6.6, 6.25, 3.0, 3.3 -> a4 b3 c1 d2: d^2 = 1 + 1 = 2,
    # rho = 1 - 6 * 2 / (4 * (16 - 1)) = 0.8 exactly (rounded to 3 places by table_stats)
    assert stats["spearman"] == 0.8
    # fastest measured is d (3.0 s), fastest predicted is c (3.0 s): a wrong pick
    assert (stats["best_measured"], stats["best_predicted"]) == ("d", "c")


def test_spearman_is_none_below_three_rows_or_for_a_constant_side():
    two = [_row("serial", 1, 1.0, 1.0), _row("a", 2, 0.6, 0.5), _row("b", 2, 0.5, 0.6)]
    assert oos.table_stats(two)["spearman"] is None
    flat = [_row("serial", 1, 1.0, 1.0)] + [_row(x, 2, 0.5, 0.4 + i / 10) for i, x in enumerate("abc")]
    assert oos.table_stats(flat)["spearman"] is None  # measured all equal: no ranking to compare


def test_best_plan_groups_compare_layouts_at_each_gpu_count():
    rows = [
        _row("serial", 1, 10.0, 10.0),
        _row("u2", 2, 6.0, 5.0),
        _row("r2", 2, 5.0, 5.5),  # best measured at 2; predicted picks u2
        _row("u4", 4, 3.0, 2.0),
        _row("r4", 4, 3.5, 2.5),  # u4 both ways
        _row("u8", 8, 2.0, 1.0),  # alone at 8: no choice, no group
    ]
    groups = oos.best_plan_groups(rows)
    assert [(g["ranks"], g["layouts"], g["match"]) for g in groups] == [(2, 2, False), (4, 2, True)]


def test_calibration_failed_flags_an_unmatched_first_row():
    assert not oos.calibration_failed([_row("serial", 1, 2.0, 2.0 * (1 + 1e-6))])
    assert oos.calibration_failed([_row("dp=32", 32, 1.5, 2.0)])


def test_new_rows_are_the_published_numbers_and_the_model_commit_is_named():
    assert re.fullmatch(r"[0-9a-f]{40}", oos.FROZEN_AT)
    table = oos.CONSISID
    # consisid.md: 12 rows, serial first here (it calibrates), GPU counts 6,6,6,6,4,4,3,3,2,2,2
    assert len(table.rows) == 12 and table.rows[0] == (table.rows[0][0], 114.87)
    assert [c.world_size for c, _ in table.rows] == [1, 6, 6, 6, 6, 4, 4, 3, 3, 2, 2, 2]
    assert [s for _, s in table.rows[1:]] == [
        44.89,
        44.24,
        35.78,
        38.35,
        41.37,
        40.68,
        53.57,
        55.51,
        70.19,
        76.56,
        59.72,
    ]
    for series in oos.TRAIN_SERIES:  # the source line quotes the very numbers the rows hold
        for _, tps in series.rows:
            assert f"{tps:,}" in series.source or str(tps) in series.source
    new_rows = sum(len(t.rows) - 1 for t in (table,)) + sum(len(s.rows) - 1 for s in oos.TRAIN_SERIES)
    assert new_rows == 15


def test_cogvideox_preset_counts_are_the_diffusers_model_counts():
    """116 aten ops per CogVideoX block with rotary embeddings and 315.0 TFLOP for the VAE
    decode of 13 x 60 x 90 latents (49 frames of 480x720), recounted on diffusers' models."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXTransformer3DModel

    from tessera.plan.host_ops import count_block_ops, decode_flops

    def cog(n: int):
        torch.manual_seed(0)
        model = CogVideoXTransformer3DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
            text_embed_dim=16, num_layers=n, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
            temporal_compression_ratio=4, max_text_seq_length=4, use_rotary_positional_embeddings=True,
        ).eval()  # fmt: skip
        rope = (torch.randn(32, 8), torch.randn(32, 8))  # 2 latent frames x 4 x 4 patches, head dim 8
        kw = dict(
            hidden_states=torch.randn(1, 2, 4, 8, 8), encoder_hidden_states=torch.randn(1, 4, 16),
            timestep=torch.tensor([10]), image_rotary_emb=rope,
        )  # fmt: skip
        return lambda: model(**kw)

    spec = PRESETS["cogvideox-5b-480p-49f"]
    assert count_block_ops(cog) == spec.host_ops_per_layer == 116
    # rel=1e-3: the preset stores 4 significant digits (315.0e12)
    assert decode_flops(AutoencoderKLCogVideoX(), (1, 16, 13, 60, 90)) == pytest.approx(
        spec.decode_flops, rel=1e-3
    )
    assert spec.tokens == 13 * 30 * 45 + 226


def test_every_link_profile_states_its_topology_and_source():
    from tessera.plan.hardware import LINK_TOPOLOGY
    from tessera.runtime.link import LINKS

    assert set(LINK_TOPOLOGY) == set(LINKS)
    assert all(topology and source for topology, source in LINK_TOPOLOGY.values())


def test_an_all_to_all_across_pcie_switches_shares_the_uplink():
    """8 GPUs, 4 per switch: each GPU sends 4/8 of its bytes to the other switch, and the 4
    GPUs below a switch push them through its one x16 uplink: 4 * 4 / 7 = 2.29x the time of
    independent sends. A ring pass crosses each uplink once per direction: unchanged; so is
    a group inside one switch, and NVSwitch (pcie_group 0)."""
    import dataclasses

    from tessera.plan.devices import device_named
    from tessera.plan.hardware import Hardware
    from tessera.runtime.link import link_named

    flat = Hardware(device=device_named("l40"), link=link_named("pcie4"))
    shared = dataclasses.replace(flat, pcie_group=4)
    b, eight = 64 * 2**20, range(8)
    # approx's default 1e-6 relative: the factor is a float ratio of the same link time
    assert shared.comm_seconds("all_to_all", b, eight) == pytest.approx(
        flat.comm_seconds("all_to_all", b, eight) * 16 / 7
    )
    for op, ranks in (("send", range(8)), ("all_gather", range(8)), ("all_to_all", range(4))):
        assert shared.comm_seconds(op, b, ranks) == flat.comm_seconds(op, b, ranks)
    # 2 of a 4-rank group on each switch: 2 * 2 / 3 = 1.33x
    assert shared.comm_seconds("all_to_all", b, [2, 3, 4, 5]) == pytest.approx(
        flat.comm_seconds("all_to_all", b, [2, 3, 4, 5]) * 4 / 3
    )
    with pytest.raises(ValueError, match="pcie_group must be an integer >= 0"):
        Hardware(device=device_named("l40"), link=link_named("pcie4"), pcie_group=-1)


def test_every_generation_preset_says_what_of_its_pipeline_it_counts():
    from tessera.plan.model_presets import PIPELINE_COUNTS

    generation = {n for n, s in PRESETS.items() if s.vocab == 0 and not s.experts}
    assert generation == set(PIPELINE_COUNTS)
    for name, counts in PIPELINE_COUNTS.items():
        spec = PRESETS[name]
        # a decode or host term in the spec is said to be counted, and its absence is said too
        assert ("decode" in counts["counted"]) == (spec.decode_flops > 0) or name == "bench-dit"
        assert ("host time" in counts["counted"]) == (spec.host_ops_per_layer > 0)
        assert counts["not counted"]
