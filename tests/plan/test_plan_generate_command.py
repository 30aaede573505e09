"""`tessera plan generate` prints its choice as a `tessera generate` command that the real
parser reads back with every planned setting: model, image size, steps, guidance, processes
and layout; a preset with no folder gets a placeholder for --model and a note saying so; on
one device the printed line of a saved pipeline runs as printed."""

import re
import shlex
import sys
from pathlib import Path

import pytest

from tessera.cli import build_parser, main
from tessera.cli_generate import build_layout
from tessera.plan.commands import PROMPT_PLACEHOLDER

sys.path.insert(0, str(Path(__file__).parents[1] / "diffusion"))


def _plan(capsys, argv: list[str]):
    """(the printed command parsed by tessera's own parser, the rank-1 layout, the notes);
    the printed words are kept on the parsed arguments as ``printed``."""
    assert main(["plan", "generate", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    choice = [line for line in out if line.startswith("choice: ")]
    assert len(choice) == 1, out
    words = shlex.split(choice[0].removeprefix("choice: "))
    assert words[:2] == ["tessera", "generate"], words
    best = next(re.split(r"\s{2,}", line.strip())[1] for line in out if re.match(r"1\s{2,}", line))
    args = build_parser().parse_args(words[1:])
    args.printed = words[1:]
    return args, best, [line for line in out if line.startswith("note: ")]


@pytest.fixture(scope="module")
def pixart(tmp_path_factory):
    from tiny_pipelines import build_pixart_pipeline

    return build_pixart_pipeline(tmp_path_factory.mktemp("plan") / "pixart")


def test_a_pipeline_folder_gets_every_planned_setting(pixart, capsys):
    argv = ["--model", str(pixart), "--devices", "2", "--steps", "3", "--height", "32", "--width", "32"]
    args, best, notes = _plan(capsys, [*argv, "--no-guidance"])
    assert (args.model, args.prompt, args.height, args.width, args.steps) == (
        str(pixart),
        PROMPT_PLACEHOLDER,
        32,
        32,
        3,
    )
    assert args.guidance <= 1.0  # planned without guidance: tessera generate's CFG branch off
    layout = build_layout(args)
    assert layout.describe() == best and args.nproc == layout.world_size == 2
    assert notes == []


def test_a_pipeline_folder_without_a_size_gets_its_own_default(pixart, capsys):
    from tessera.cli_generate import _size
    from tessera.diffusion.pipelines import meta_pipeline

    args, best, _ = _plan(capsys, ["--model", str(pixart), "--devices", "2", "--steps", "2"])
    default = _size(meta_pipeline(pixart), {"height": None, "width": None})
    assert (args.height, args.width) == default and args.guidance > 1.0  # planned with guidance
    assert build_layout(args).describe() == best


def test_one_device_plan_runs_as_printed(pixart, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the printed line writes --out's default, grid.png, here
    args, _, _ = _plan(capsys, ["--model", str(pixart), "--devices", "1", "--steps", "2"])
    assert args.nproc == 1
    assert main(args.printed) == 0
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_presets_get_a_placeholder_and_a_note(capsys):
    # few steps: the simulator's time grows with them, and they change no printing
    args, best, notes = _plan(capsys, ["--model", "flux-dev", "--devices", "4", "--steps", "2"])
    assert args.model == "<PIPELINE_DIR>" and (args.height, args.width, args.steps) == (1024, 1024, 2)
    assert build_layout(args).describe() == best and args.nproc == 4
    assert len(notes) == 1 and "flux-dev is a planner preset" in notes[0] and "<PIPELINE_DIR>" in notes[0]

    args, best, notes = _plan(capsys, ["--model", "bench-dit", "--devices", "2", "--steps", "4"])
    assert args.model == "<DIT_CHECKPOINT>" and args.prompt is None and args.height is None
    assert args.steps == 4 and build_layout(args).describe() == best
    assert len(notes) == 1 and "Tessera DiT checkpoint" in notes[0]

    args, _, notes = _plan(capsys, ["--model", "gpt2", "--devices", "2"])
    assert args.model == "<PIPELINE_DIR>" and "tessera generate samples PixArt" in notes[0]


def test_half_a_size_is_refused(capsys):
    assert main(["plan", "generate", "--model", "flux-dev", "--devices", "2", "--height", "512"]) == 2
    assert "only --height 512: give --height and --width together" in capsys.readouterr().err
