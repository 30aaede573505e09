"""One naming scheme (issue 29 item 1, docs/conventions.md "Names"): the Plan and
ParallelConfig flags come from their fields, old names keep working for a release with a
warning, and `tessera train` dispatches through the recipe registry. No model is built here."""

import argparse
import dataclasses

import pytest

from tessera import cli
from tessera.cli_flags import LAYOUT, PLAN, as_flags, flag, given
from tessera.cli_train import RECIPES, _plan
from tessera.diffusion.layout import ParallelConfig
from tessera.train.plan import Plan


def _subparser(*path: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize(("verb", "settings"), [(("train",), PLAN), (("generate",), LAYOUT)])
def test_every_field_has_a_flag_with_the_classes_own_choices(verb, settings):
    options = _options(_subparser(*verb))
    for f in dataclasses.fields(settings.cls):
        action = options[flag(f.name)]  # a KeyError names the field without a flag
        assert action.dest == f.name and action.help
        if f.name in settings.choices:
            assert tuple(action.choices) == settings.choices[f.name]


def test_flags_build_the_value_and_print_back_to_the_same_flags():
    argv = ["train", "--recipe", "gpt2-text", "--nproc", "4", "--pp", "2", "--microbatches", "4"]
    argv += ["--stage-layers", "2,1", "--zero", "1", "--loss-scale-init", "1024", "--precision", "bf16"]
    args = cli.build_parser().parse_args(argv)
    plan = _plan(RECIPES["gpt2-text"], given(args, PLAN), args.nproc)
    assert plan == Plan(
        dp=2, pp=2, microbatches=4, stage_layers=(2, 1), zero=1, loss_scale_init=1024.0, precision="bf16"
    )
    again = cli.build_parser().parse_args(
        ["train", "--recipe", "gpt2-text", "--nproc", "4", *as_flags(plan, PLAN).split()]
    )
    assert _plan(RECIPES["gpt2-text"], given(again, PLAN), 4) == plan
    args = cli.build_parser().parse_args(
        ["generate", "--model", "m", "--pipefusion", "2", "--stage-layers", "3,2"]
    )
    assert ParallelConfig(**given(args, LAYOUT)) == ParallelConfig(pipefusion=2, stage_layers=(3, 2))


def test_counts_have_one_spelling_resolved_when_made():
    assert Plan(pp=2).microbatches == 2 and Plan().microbatches == 1
    assert ParallelConfig(pipefusion=2).patches == 2 and ParallelConfig().patches == 1
    assert as_flags(Plan(pp=2), PLAN) == "--pp 2"  # the resolved default prints no flag


def test_old_parallel_config_names_still_work_and_warn():
    with pytest.warns(FutureWarning, match="pipefusion_degree is renamed pipefusion"):
        config = ParallelConfig(pipefusion_degree=2, num_patches=4)
    assert config == ParallelConfig(pipefusion=2, patches=4)
    with pytest.warns(FutureWarning, match="ParallelConfig.tp_degree is renamed tp"):
        assert ParallelConfig(tp=2).tp_degree == 2


@pytest.mark.parametrize(
    ("old", "new", "dest", "value"),
    [
        (["plan", "train", "--dtype", "fp32"], "--precision", "precision", "fp32"),
        (["plan", "train", "--global-batch", "16"], "--batch-size", "batch_size", 16),
        (["plan", "memory", "--width", "64"], "--hidden-size", "hidden_size", 64),
    ],
)
def test_an_old_flag_name_still_works_and_warns(old, new, dest, value):
    if old[1] != "memory":
        old = [*old, "--model", "gpt2", "--devices", "2"]
    with pytest.warns(FutureWarning, match=f"{old[2]} is renamed {new}"):
        args = cli.build_parser().parse_args(old)
    assert getattr(args, dest) == value


def test_the_command_line_shows_an_old_name_as_one_warning_line(capsys):
    argv = [
        "plan",
        "train",
        "--model",
        "gpt2",
        "--devices",
        "2",
        "--global-batch",
        "4",
        "--offload",
        "--top",
        "1",
    ]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "tessera: warning: --global-batch is renamed --batch-size; the old name goes in the next release",
        "tessera: warning: --offload without a policy is renamed --offload static --offload auto; "
        "the old name goes in the next release",
    ]
    assert "batch 4 x 1024 tokens" in captured.out


def test_recipes_are_a_registry_with_their_own_output_folders(tmp_path, capsys, monkeypatch):
    assert {name: r.default_out for name, r in RECIPES.items()} == {
        "digits-dit": "runs/digits-dit",
        "gpt2-text": "runs/gpt2-text",
        "rocbert-sentiment": "runs/rocbert-sentiment",
    }
    seen = {}
    monkeypatch.setattr(
        "tessera.cli_train.train_gpt2_text", lambda args, plan, out: seen.update(plan=plan, out=out) or "ran"
    )
    assert cli.main(["train", "--recipe", "gpt2-text", "--nproc", "2", "--sp", "2"]) == 0
    assert seen["plan"] == Plan(sp=2) and str(seen["out"]) == "runs/gpt2-text"
    assert capsys.readouterr().out == "ran\n"
    assert RECIPES["rocbert-sentiment"].plan_defaults == {"max_grad_norm": 1.0}  # its own Plan default
    err = (cli.main(["train", "--recipe", "digits-dit", "--resume", "--sp", "2"]), capsys.readouterr().err)
    assert err[0] == 2 and "it does not take --sp (they apply to gpt2-text)" in err[1]
