import pytest
import torch

from tessera.memory.chunk import Chunk, pack


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 4, generator=g)),
        ("b", torch.randn(5, generator=g)),
        ("big", torch.randn(40, generator=g)),
        ("c", torch.randn(2, 2, generator=g)),
    ]


def test_pack_keeps_order_values_and_alignment():
    chunks = pack(_named(), chunk_elems=20, align=4)
    layout = [[(s.name, s.offset) for s in c.slots] for c in chunks]
    # a (12) + b (5) fill the first chunk; big (40) gets its own; c starts a new one. Each is
    # trimmed to what it holds, rounded up to the alignment: 17 -> 20, 40, 4.
    assert layout == [[("a", 0), ("b", 12)], [("big", 0)], [("c", 0)]]
    assert [c.capacity for c in chunks] == [20, 40, 4] and all(c.capacity % 4 == 0 for c in chunks)
    for name, tensor in _named():
        chunk = next(c for c in chunks if any(s.name == name for s in c.slots))
        slot = next(s for s in chunk.slots if s.name == name)
        assert torch.equal(chunk.view(slot), tensor)


def test_views_alias_the_buffer_and_shards_cover_it():
    (chunk,) = pack([("w", torch.ones(6))], chunk_elems=8, align=2)
    view = chunk.view(chunk.slots[0])
    view.mul_(3)
    assert chunk.buffer[:6].eq(3).all() and chunk.buffer[6:].eq(0).all()
    assert torch.equal(torch.cat([chunk.shard(r, 2) for r in range(2)]), chunk.buffer)


def test_dtypes_never_share_a_chunk_and_bad_input_is_named():
    chunks = pack(
        [("x", torch.ones(2)), ("h", torch.ones(2, dtype=torch.bfloat16)), ("y", torch.ones(2))],
        chunk_elems=8,
    )
    assert [[s.name for s in c.slots] for c in chunks] == [["x", "y"], ["h"]]
    with pytest.raises(ValueError, match="tensor 'h' is torch.bfloat16, but this chunk holds torch.float32"):
        Chunk(8, torch.float32).append("h", torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="chunk_elems and align must be >= 1, got 0 and 1"):
        pack([], chunk_elems=0)
