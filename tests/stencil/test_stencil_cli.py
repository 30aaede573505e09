"""`tessera stencil wave`: writes its snapshots; a CFL past stability is a one-line error."""

from tessera.cli import main


def test_wave_command_writes_snapshots(tmp_path, capsys):
    out = tmp_path / "wave"
    code = main(["stencil", "wave", "--shape", "star13", "--grid", "16,12,20", "--steps", "12", "--snapshots", "2",
                 "--velocity", "smooth", "--threads", "2", "--out", str(out)])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["wave_00006.png", "wave_00012.png"]
    text = capsys.readouterr().out
    assert "12 steps" in text and "GPts/s" in text and "wrote 2 snapshot(s)" in text


def test_wave_command_refuses_unstable_cfl(tmp_path, capsys):
    code = main(["stencil", "wave", "--shape", "ete73", "--cfl", "0.9", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert "CFL number 0.9 exceeds the leapfrog stability limit" in err and "of ete73" in err
