"""Mesh layout and exact comm byte counts on 4 real gloo ranks (one spawned group)."""

import torch

from tessera.runtime import Mesh, spawn

F32 = 4  # bytes per float32 element


def _mesh_and_comm_checks() -> dict:
    mesh = Mesh(dp=2, tp=2)
    r, out = mesh.global_rank, {}
    out["coords"] = mesh.coords
    out["peer_tp1"] = mesh.global_rank_of("tp", 1)
    out["peer_dp0"] = mesh.global_rank_of("dp", 0)
    out["group_sizes"] = {a: torch.distributed.get_world_size(mesh.group(a)) for a in mesh.names}
    comm, ledger = mesh.comm, mesh.comm.ledger

    t = torch.full((3, 5), float(r))
    comm.all_reduce(t, "dp")
    out["all_reduce"] = t[0, 0].item()

    gathered = comm.all_gather(torch.full((2, 3), float(r)), "tp", dim=1)
    out["all_gather"] = gathered[0].tolist()

    rs = comm.reduce_scatter(torch.arange(8, dtype=torch.float32).view(4, 2) + r, "tp", dim=0)
    out["reduce_scatter"] = rs.tolist()

    # all_to_all: scatter rows (dim 0), gather along columns (dim 1).
    a2a = comm.all_to_all(
        torch.full((4, 1), float(r)) + torch.arange(4.0)[:, None] * 10, "tp", scatter_dim=0, gather_dim=1
    )
    out["all_to_all"] = a2a.tolist()

    b = torch.full((7,), float(r))
    comm.broadcast(b, "dp", src=1)
    out["broadcast"] = b[0].item()

    buf = torch.empty(6)
    if mesh.rank("tp") == 0:
        comm.isend(torch.full((6,), 42.0), "tp", dst=1).wait()
    else:
        comm.irecv(buf, "tp", src=0).wait()
        out["recv"] = buf.tolist()
    out["ledger"] = ledger.snapshot()
    out["total_dp"] = ledger.total(axis="dp")
    out["count"] = ledger.count()
    ledger.reset()
    out["after_reset"] = ledger.total()
    return out


def test_mesh_layout_and_exact_comm_bytes():
    results = spawn(_mesh_and_comm_checks, 4, timeout_s=120)
    for rank, res in enumerate(results):
        dp, tp = divmod(rank, 2)  # row-major: the last axis varies fastest
        assert res["coords"] == {"dp": dp, "tp": tp}
        assert res["peer_tp1"] == dp * 2 + 1
        assert res["peer_dp0"] == tp
        assert res["group_sizes"] == {"dp": 2, "tp": 2}
        # sum over the dp group {tp, tp + 2}
        assert res["all_reduce"] == tp + (tp + 2)
        assert res["all_gather"] == [2 * dp] * 3 + [2 * dp + 1] * 3
        full = [[2 * x + (2 * dp) + (2 * dp + 1) for x in range(2 * i, 2 * i + 2)] for i in range(4)]
        assert res["reduce_scatter"] == full[2 * tp : 2 * tp + 2]
        # row i of rank s's input is s + 10*i; I get rows {2*tp, 2*tp+1} of both tp peers.
        peers = [2 * dp, 2 * dp + 1]
        assert res["all_to_all"] == [[p + 10 * (2 * tp + j) for p in peers] for j in range(2)]
        assert res["broadcast"] == 2 + tp  # dp coordinate 1 of my dp group
        if tp == 1:
            assert res["recv"] == [42.0] * 6
        # Exact bytes under the documented convention (see runtime/comm.py).
        expected = {
            "all_reduce@dp": {"bytes": 15 * F32, "calls": 1},
            "all_gather@tp": {"bytes": 6 * F32, "calls": 1},
            "reduce_scatter@tp": {"bytes": 8 * F32, "calls": 1},
            "all_to_all@tp": {"bytes": 4 * F32, "calls": 1},
            "broadcast@dp": {"bytes": 7 * F32, "calls": 1},
            ("send@tp" if tp == 0 else "recv@tp"): {"bytes": 6 * F32, "calls": 1},
        }
        assert res["ledger"] == expected
        assert res["total_dp"] == (15 + 7) * F32
        assert res["count"] == 6
        assert res["after_reset"] == 0
