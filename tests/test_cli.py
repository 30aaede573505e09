"""The command line: a real (tiny) train -> generate run, and one-line errors."""

import json

import pytest

from tessera import cli


def _error_of(capsys, argv) -> str:
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, never a traceback
    assert err.startswith("tessera: error: ")
    return err


def test_train_then_generate_then_resume(tmp_path, capsys):
    out = tmp_path / "ck"
    assert (
        cli.main(["train", "--recipe", "digits-dit", "--nproc", "1", "--out", str(out), "--steps", "2"]) == 0
    )
    assert "trained 2 steps" in capsys.readouterr().out
    png = tmp_path / "grid.png"
    args = [
        "generate",
        "--model",
        str(out),
        "--digits",
        "07",
        "--per-digit",
        "2",
        "--steps",
        "2",
        "--out",
        str(png),
    ]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert png.stat().st_size > 0 and "class accuracy of the samples" in printed
    first = png.read_bytes()
    assert cli.main(args) == 0 and png.read_bytes() == first  # same seed, same picture
    capsys.readouterr()
    # Training again into the same folder must not destroy it; --resume continues it.
    err = _error_of(capsys, ["train", "--recipe", "digits-dit", "--out", str(out), "--steps", "3"])
    assert "already holds a checkpoint; pass --resume" in err
    assert cli.main(["train", "--recipe", "digits-dit", "--out", str(out), "--steps", "3", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"resumed from step 2 (plan dp=1 tp=1; checkpoint {out})" in printed
    assert "trained 1 steps" in printed
    log = [json.loads(line) for line in out.with_name("ck.train_log.jsonl").read_text().splitlines()]
    assert [e.get("step", e.get("resumed_from")) for e in log] == [2, 2, 3]  # kept, marked, appended
    assert log[1] == {"resumed_from": 2, "plan": log[1]["plan"]} and log[1]["plan"]["dp"] == 1
    # A class-conditional checkpoint refuses text (and a pipeline's size) by name, never ignores it
    err = _error_of(capsys, [*args[:3], "--prompt", "a red cat"])
    assert "--prompt: " in err and "class-conditional Tessera DiT" in err and "--digits" in err
    assert "--height: " in _error_of(capsys, [*args[:3], "--height", "16"])


def _pixels(path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path), dtype=np.int16)


def test_parallel_generate_gives_the_serial_picture(tmp_path, capsys):
    out = tmp_path / "ck"
    assert cli.main(["train", "--recipe", "digits-dit", "--out", str(out), "--steps", "30"]) == 0
    common = ["generate", "--model", str(out), "--digits", "38", "--per-digit", "2", "--steps", "3"]
    assert cli.main([*common, "--out", str(tmp_path / "serial.png")]) == 0
    exact = ["--nproc", "2", "--pipefusion", "2", "--patches", "2", "--warmup-steps", "3"]
    assert cli.main([*common, *exact, "--out", str(tmp_path / "pipefusion.png")]) == 0
    assert cli.main([*common, "--nproc", "2", "--ulysses", "2", "--out", str(tmp_path / "ulysses.png")]) == 0
    assert "pipefusion=2 (patches=2, warmup_steps=3), 2 process(es)" in capsys.readouterr().out
    serial = _pixels(tmp_path / "serial.png")
    for name in ("pipefusion", "ulysses"):
        # Exact layouts: float32 rounding can move a pixel across a uint8 boundary, no more.
        assert abs(_pixels(tmp_path / f"{name}.png") - serial).max() <= 1, name
    err = _error_of(
        capsys, [*common, "--nproc", "2", "--ring", "2", "--ulysses", "2", "--out", str(tmp_path / "x.png")]
    )
    assert "ring=2 x ulysses=2 needs 4 processes but --nproc is 2" in err
    err = _error_of(capsys, [*common, "--nproc", "2", "--pipefusion", "2", "--patches", "1"])
    assert "patches 1 is fewer than the 2 pipeline stages" in err


def test_bad_inputs_give_one_line_errors(tmp_path, capsys):
    missing = tmp_path / "none"
    assert "no checkpoint at" in _error_of(
        capsys, ["generate", "--model", str(missing), "--out", str(tmp_path / "a.png")]
    )
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{")
    assert "is corrupt" in _error_of(
        capsys, ["generate", "--model", str(corrupt), "--out", str(tmp_path / "a.png")]
    )
    assert "got '12x'" in _error_of(capsys, ["generate", "--model", str(corrupt), "--digits", "12x"])
    assert "folder /no/such does not exist" in _error_of(
        capsys, ["generate", "--model", str(corrupt), "--out", "/no/such/a.png"]
    )
    err = _error_of(capsys, ["train", "--recipe", "digits-dit", "--nproc", "3", "--out", str(tmp_path / "x")])
    assert "batch size 128 is not divisible by --nproc 3" in err
    assert "unknown recipe 'mnist'" in _error_of(capsys, ["train", "--recipe", "mnist"])
    assert "no training state to resume" in _error_of(
        capsys, ["train", "--recipe", "digits-dit", "--out", str(missing), "--resume"]
    )


def test_nproc_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--recipe", "digits-dit", "--nproc", "0"])
    assert "expected a positive integer, got 0" in capsys.readouterr().err


def test_train_gpt2_text_under_a_plan_then_resume_under_another(tmp_path, capsys):
    out = tmp_path / "gpt2"
    common = ["train", "--recipe", "gpt2-text", "--out", str(out)]
    assert cli.main([*common, "--nproc", "2", "--zero", "3", "--grad-accum", "2", "--steps", "3"]) == 0
    assert "trained 3 steps of gpt2-text with dp=2 tp=1 zero=3" in capsys.readouterr().out
    assert cli.main([*common, "--nproc", "2", "--tp", "2", "--steps", "5", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert (
        f"resumed from step 3 (plan dp=2 tp=1 zero=3 grad_accum=2; checkpoint {out / 'checkpoint'}), "
        "continuing under plan dp=1 tp=2" in printed
    )
    assert "trained 2 steps of gpt2-text with dp=1 tp=2 zero=0" in printed
    log = json.loads((out / "train_log.json").read_text())
    assert [e["step"] for e in log["log"]] == [3, 5]  # the first run's entry kept, the resume's appended
    assert log["plan"]["zero"] == 3 and [(r["resumed_from"], r["plan"]["tp"]) for r in log["resumes"]] == [
        (3, 2)
    ]
    from transformers import AutoTokenizer, GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(out / "hf")  # the export loads with HF's own class
    assert model.config.vocab_size == 256
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")  # the recipe's byte tokenizer beside it
    text = "naïve café, 日本語 ✓ — «ok»"
    assert (
        tokenizer(text)["input_ids"] == list(text.encode()) and tokenizer.decode(list(text.encode())) == text
    )
    capsys.readouterr()  # from_pretrained's progress bar
    assert cli.main([*common, "--steps", "4", "--resume"]) == 0  # nothing to do: no step run, none lost
    assert "is already trained to step 5 (of 4); nothing to do" in capsys.readouterr().out
    assert "already holds a checkpoint" in _error_of(capsys, [*common, "--nproc", "2"])
    assert "--nproc 2 is not a multiple of --tp 3" in _error_of(
        capsys, [*common, "--nproc", "2", "--tp", "3", "--resume"]
    )
    assert "Plan dp=2 x tp=2 = 4 processes, but the world has 2" in _error_of(
        capsys, [*common, "--nproc", "2", "--dp", "2", "--tp", "2", "--resume"]
    )
    assert "apply to gpt2-text" in _error_of(capsys, ["train", "--recipe", "digits-dit", "--zero", "2"])


def test_train_gpt2_text_fp16_with_activation_checkpointing_and_block_chunks(tmp_path, capsys):
    out = tmp_path / "gpt2-fp16"
    common = ["train", "--recipe", "gpt2-text", "--out", str(out), "--batch-size", "4"]
    flags = ["--precision", "fp16", "--activation-checkpointing", "--block-chunks", "--zero", "3"]
    assert cli.main([*common, *flags, "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "trained 2 steps of gpt2-text with dp=1 tp=1 zero=3" in printed and "fp16 steps skipped" in printed
    assert cli.main([*common, "--precision", "fp16", "--steps", "3", "--resume"]) == 0  # another plan
    assert "trained 1 steps" in capsys.readouterr().out
    assert "apply to gpt2-text" in _error_of(
        capsys, ["train", "--recipe", "digits-dit", "--activation-checkpointing"]
    )


def test_square_only_names_what_it_needs(capsys):
    """`--square-only` belongs to the kernels benchmark's full plan: elsewhere, a one-line error
    before anything runs."""
    assert "got bench 'serve'" in _error_of(capsys, ["bench", "serve", "--square-only"])
    assert "with --quick" in _error_of(capsys, ["bench", "kernels", "--square-only", "--quick"])
    assert "got bench 'stencil'" in _error_of(capsys, ["bench", "stencil", "--tvm-only"])


def test_serve_model_names_what_it_needs(capsys):
    """`--model` picks one model of the serve benchmark's full plan: elsewhere, or a model not in
    it, a one-line error before anything runs."""
    assert "got bench 'kernels'" in _error_of(capsys, ["bench", "kernels", "--model", "12x768"])
    assert "with --quick" in _error_of(capsys, ["bench", "serve", "--model", "12x768", "--quick"])
    assert "choose one of 6x384, 12x768" in _error_of(capsys, ["bench", "serve", "--model", "12x769"])
