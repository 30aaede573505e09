"""The length-aware memory plan: placements never overlap two tensors alive at once, the
chunks held stay within 1.2x of the largest peak of live bytes, chunks are reused across
batches (none allocated in steady state, on recurring shapes and on a mix of new ones), and
a forward run inside the plan asks torch's allocator for nothing and computes what the
model computes."""

import random

import pytest
import torch

from tessera.memory.track import TensorMemory
from tessera.serve.memory_plan import CHUNK_BYTES, Usage, aligned, plan_memory
from tessera.serve.model import load_model, reference_outputs
from tessera.serve.synthetic import FAMILIES, EncoderSpec, build_encoder
from tessera.serve.unpadded import UnpaddedRunner


def check_valid(usages, plan):
    spans = {}
    for u, (chunk, offset) in zip(usages, plan.placements, strict=True):
        assert offset + aligned(u.size) <= plan.chunk_sizes[chunk]
        spans.setdefault(chunk, []).append((offset, offset + aligned(u.size), u))
    for items in spans.values():
        for i, (a0, a1, ua) in enumerate(items):
            for b0, b1, ub in items[i + 1 :]:
                if ua.overlaps(ub):
                    assert a1 <= b0 or b1 <= a0, (ua, ub)  # alive together: apart in memory


def random_usages(rng, n=60, ops=200):
    out = []
    for _ in range(n):
        first = rng.randrange(ops)
        out.append(Usage(rng.choice([rng.randrange(1, 4096), rng.randrange(1, 6 * 2**20)]), first,
                         min(ops, first + rng.randrange(1, 40))))  # fmt: skip
    return out


def test_placements_never_overlap_live_tensors_and_chunks_are_reused():
    rng = random.Random(0)
    for _ in range(20):
        usages = random_usages(rng)
        plan = plan_memory(usages)
        check_valid(usages, plan)
        assert plan.footprint >= plan.peak_live
        assert all(size >= CHUNK_BYTES for size in plan.chunk_sizes)
        again = plan_memory(usages, plan.chunk_sizes)  # the same batch on the chunks held
        assert again.new_chunks == 0 and again.placements == plan.placements
        smaller = [Usage(u.size // 2, u.first, u.last) for u in usages]
        reuse = plan_memory(smaller, plan.chunk_sizes)
        check_valid(smaller, reuse)


def test_best_fit_takes_the_smallest_gap():
    u = 64  # bytes per unit: aligned sizes
    usages = [Usage(1000 * u, 0, 1), Usage(900 * u, 0, 10), Usage(800 * u, 0, 1), Usage(700 * u, 0, 10),
              Usage(500 * u, 5, 10)]  # fmt: skip
    plan = plan_memory(usages)
    assert [offset // u for _, offset in plan.placements[:4]] == [
        0,
        1000,
        1900,
        2700,
    ]  # largest first, stacked
    # Once the 1000 and the 800 died, the 500 fits both holes: it takes the smaller (first fit would take 0).
    assert plan.placements[4] == (0, 1900 * u)
    assert plan.peak_live == 3400 * u and plan.footprint == CHUNK_BYTES


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    spec = EncoderSpec(layers=2, hidden=256, heads=4, intermediate=1024, vocab_size=300, max_length=512)
    return build_encoder(tmp_path_factory.mktemp("arena") / "wide", spec)


def tokens(lengths, seed=0, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [[2, *torch.randint(5, vocab, (n - 2,), generator=g).tolist(), 3] for n in lengths]


def test_steady_state_allocates_nothing_and_the_footprint_is_near_the_peak(wide_dir):
    served = load_model(wide_dir)
    runner = UnpaddedRunner(served, attention="padded", memory_plan=True)
    plain = UnpaddedRunner(served, attention="padded")
    arena = runner.arena
    assert arena.trace.unplanned_ops == []  # every allocating op writes into the plan
    shapes = [[480, 300, 512, 200, 390, 410, 100, 330], [64, 500, 7, 250], [512] * 8]
    for cycle in range(3):
        for k, lengths in enumerate(shapes):
            sequences = tokens(lengths, seed=k)
            before = dict(arena.stats)
            with TensorMemory() as mem:
                got = runner(sequences)
            # fp32; the per-head matmul+softmax attention against SDPA: a few ulp per op (see test_unpadded)
            torch.testing.assert_close(got, plain(sequences), atol=1e-5, rtol=1e-5)
            # No op inside the planned forward asks the allocator, at any shape (first batch included).
            assert arena.stats["allocations"] == before["allocations"], arena.stats
            if cycle >= 1:
                assert arena.stats["chunk_allocations"] == before["chunk_allocations"]
                # a shape planned before the largest one re-cut the held set is planned once
                # more on the new set (no chunk allocated); from then on its plan is cached
                assert cycle == 1 or arena.stats["plans"] == before["plans"]
                # What is left: the batch's token ids, positions and attention index tensors
                # (built before the forward, ~50 bytes a token) and the copied-out answer.
                assert mem.peak <= 64 * sum(lengths) + 4 * len(lengths) * served.output_dim, mem.peak
            plan = arena.last_plan
            print(f"{lengths}: peak live {plan.peak_live / 2**20:.1f} MiB, chunks held "
                  f"{arena.held_bytes() / 2**20:.1f} MiB")  # fmt: skip
    largest = max(arena.usages_peak(lengths) for lengths in shapes)
    # the aim: what the server holds across the shapes within 1.2x the largest batch's need
    assert arena.held_bytes() <= 1.2 * largest, (arena.held_bytes(), largest)
    assert arena.stats["diverged"] == arena.stats["misplaced"] == 0
    with TensorMemory() as unplanned:
        plain(tokens(shapes[0]))
    assert unplanned.peak > 10 * 2**20  # without the plan the same forward allocates tens of MiB


def test_a_mix_of_new_shapes_reaches_steady_state(wide_dir):
    """Fifteen distinct batch shapes in turn, as a server sees them (sorted runs, then arrival
    order): after one pass the chunks held are within 1.2x the largest batch's peak of live
    bytes, and a second pass allocates no chunk (the largest batch yet re-cuts the held set
    from nothing; smaller ones fit inside or add what they lack)."""
    served = load_model(wide_dir)
    arena = UnpaddedRunner(served, attention="padded", memory_plan=True).arena
    rng = random.Random(3)
    lengths = [rng.randint(8, 512) for _ in range(64)]
    ordered = sorted(lengths)
    batches = [ordered[i : i + 8] for i in range(0, 64, 8)] + [lengths[i : i + 9] for i in range(0, 63, 9)]
    assert len({(sum(b), len(b), max(b)) for b in batches}) == 15
    for batch in batches:  # the plans alone: the forward inside them is the other tests'
        arena.plan(batch)
    first = dict(arena.stats)
    for batch in batches:
        arena.plan(batch)
    assert arena.stats["chunk_allocations"] == first["chunk_allocations"], (first, arena.stats)
    largest = max(arena.usages_peak(b) for b in batches)
    assert arena.held_bytes() <= 1.2 * largest, (arena.held_bytes() / 2**20, largest / 2**20)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_planned_and_equals_one_request_at_a_time(encoder_dirs, family):
    for task in ("embed", "classify"):
        served = load_model(encoder_dirs[family, task])
        runner = UnpaddedRunner(served, attention="padded", memory_plan=True)
        assert runner.arena.trace.unplanned_ops == [], runner.arena.trace.unplanned_ops
        for lengths in ([7], [20, 3, 64, 9], [33, 33]):
            sequences = tokens(lengths, vocab=served.config.vocab_size)
            # fp32, the batch against one input alone: GEMM blocking and SDPA's split change the
            # order of sums only (see test_unpadded for why 1e-5)
            torch.testing.assert_close(
                runner(sequences), reference_outputs(served, sequences), atol=1e-5, rtol=1e-5
            )
        assert runner.arena.stats["diverged"] == runner.arena.stats["misplaced"] == 0


def test_the_memory_plan_needs_the_padded_split(encoder_dirs):
    served = load_model(encoder_dirs["bert", "embed"])
    with pytest.raises(ValueError, match="needs attention 'padded'"):
        UnpaddedRunner(served, memory_plan=True)
