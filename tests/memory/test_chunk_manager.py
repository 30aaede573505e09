"""ChunkManager: parameters packed by optimizer group, bound to chunk storage that can be
freed and restored without breaking the parameters (or autograd's saved views of them)."""

import torch
from torch import nn

from tessera.memory.chunk_manager import ChunkManager


def test_groups_pack_apart_and_bound_parameters_survive_free_and_restore():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    groups = [{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias, model[1].bias]}]
    manager = ChunkManager(groups, chunk_elems=1000, align=2)
    assert [pc.group_index for pc in manager.chunks] == [0, 1]  # one optimizer group per chunk
    assert [pc.chunk.capacity for pc in manager.chunks] == [18, 6]  # 12 + 6 weights; 3 + 2 biases -> 6
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for pc in manager.chunks:
        pc.bind()
    x = torch.randn(5, 4)
    out = model(x)  # autograd saves views of the chunk buffers
    for pc in manager.chunks:
        pc.free()
        assert pc.chunk.buffer.untyped_storage().nbytes() == 0
    for pc in manager.chunks:
        buffer = pc.restore()
        with torch.autograd._unsafe_preserve_version_counter(buffer):
            buffer.zero_()
        for slot, p in zip(pc.chunk.slots, pc.params, strict=True):
            with torch.autograd._unsafe_preserve_version_counter(buffer):
                pc.chunk.view(slot).copy_(before[[n for n, q in model.named_parameters() if q is p][0]])
    out.sum().backward()  # the refilled storage serves the backward
    ref = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    ref.load_state_dict(before)
    ref(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        # the same ops on the same weights (expected bit-equal): assert_close's fp32 default
        # (rtol 1.3e-6, atol 1e-5) leaves room for rounding only; a stale buffer is O(1) off
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_segments_start_new_chunks_and_never_share_one():
    """Block-aligned chunks: a chunk holds one segment's parameters (here 3 'blocks' of two
    tensors, plus unsegmented ones before and after), even when the size would allow more."""
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(5)))
    params = list(model.parameters())
    segment_of = {p: i // 2 - 1 for i, p in enumerate(params) if 2 <= i < 8}  # layers 1-3
    manager = ChunkManager([{"params": params}], chunk_elems=1000, align=2, segment_of=segment_of)
    index = {id(p): i for i, p in enumerate(params)}
    held = [[index[id(p)] for p in pc.params] for pc in manager.chunks]
    assert held == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    unsegmented = ChunkManager([{"params": params}], chunk_elems=1000, align=2)
    assert len(unsegmented.chunks) == 1
