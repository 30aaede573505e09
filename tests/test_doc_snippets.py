"""Every Python and shell snippet in docs/*.md and README.md is either executed here at tiny
size or marked as illustrative on purpose.

The mark is an HTML comment on the line right before the fence, with the reason::

    <!-- illustrative: trains for minutes on 4 processes; tests/train/... runs it at tiny size -->
    ```bash
    tessera train --recipe gpt2-text --nproc 4 ...
    ```

A block that is not marked must be listed in ``EXECUTED`` below (by its file and a piece of
its text) and is run: Python in a fresh interpreter (with an optional prelude that makes
the names it assumes, and replacements that shrink its sizes or aim its paths at a
temporary folder), shell lines that start with ``tessera`` through ``tessera.cli.main``. A fence without a language fails
too (``text`` for output, ``bash`` for commands), and so does an ``EXECUTED`` entry that
matches no block. Even illustrative shell blocks are checked: every ``tessera ...`` line in
any shell block must parse with the real command line (a renamed or removed flag fails
here), and every ``examples/*.py`` one names must exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
README = ROOT / "README.md"
MARK = re.compile(r"^\s*<!--\s*illustrative:(.*?)-->\s*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")
LANGUAGES = {
    "python": "python", "py": "python", "pycon": "python",
    "bash": "shell", "sh": "shell", "shell": "shell", "console": "shell", "zsh": "shell",
}  # fmt: skip


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    info: str
    code: str
    mark: str | None  # the illustrative reason, None when unmarked

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def language(self) -> str | None:
        return LANGUAGES.get(self.info.lower()) if self.info else None


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].lstrip().startswith(fence):
            body.append(lines[i])
            i += 1
        mark = MARK.match(lines[start - 1]) if start else None
        found.append(
            Block(path, start + 1, info, "\n".join(body) + "\n", mark.group(1).strip() if mark else None)
        )
        i += 1
    return found


# ---- what is executed, and how ------------------------------------------------------------


@dataclass
class Run:
    """How to execute one block: ``prelude`` runs first (Python), each ``replace`` pair is
    applied to the block's text (to shrink sizes or aim paths at a temporary folder; the
    text ``TMP`` in a replacement becomes that folder)."""

    file: str
    contains: str
    prelude: str = ""
    replace: dict[str, str] = field(default_factory=dict)
    same_as: str | None = None  # the block is this file's text (the file itself runs elsewhere)


OFFLOAD_PRELUDE = """
import torch
from torch import nn

class Tiny(nn.Module):  # repeated blocks in an nn.ModuleList: what block_chunks cuts at
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x).relu()
        return x

with torch.device("meta"):
    model_on_meta = Tiny()
model = Tiny()
"""

EXECUTED = [
    Run("docs/autochunk.md", "chunked = tessera.autochunk(model, example_inputs)"),
    Run("docs/conventions.md", "config = ParallelConfig("),
    Run("docs/launch.md", 'r"""Train under `tessera launch`', same_as="examples/launch_train.py"),
    Run(
        "docs/offload.md",
        "print(memory_report(model_on_meta, plan)",
        prelude=OFFLOAD_PRELUDE,
        replace={'offload_dir="/nvme/tessera",': 'offload_dir="TMP",'},
    ),
    Run("docs/offload.md", "tessera plan memory", replace={"/tmp/x": "TMP"}),
    Run("docs/offload.md", "with accelerate.init_empty_weights():"),
    # the simulator's time grows with the steps (28: ~20 s here); 2 steps run the same search
    Run("docs/plan.md", "tessera plan generate --model flux-dev", replace={"--steps 28": "--steps 2"}),
    Run("docs/serving.md", "tessera serve --make-example-model", replace={"./my-encoder": "TMP/my-encoder"}),
]


def _entry(block: Block) -> Run | None:
    rel = str(block.path.relative_to(ROOT))
    hits = [r for r in EXECUTED if r.file == rel and r.contains in block.code]
    assert len(hits) <= 1, f"{block.where}: {len(hits)} EXECUTED entries match this block"
    return hits[0] if hits else None


def _problems(path: Path) -> list[str]:
    problems = []
    for block in blocks(path):
        if not block.info:
            problems.append(
                f"{block.where}: a fence without a language: ```text for output, ```bash for commands"
            )
            continue
        if block.language is None:
            continue  # text, json, yaml, C, ...: not run
        entry = _entry(block)
        if block.mark is not None and not block.mark:
            problems.append(f"{block.where}: <!-- illustrative: --> needs a reason after the colon")
        elif block.mark is not None and entry is not None:
            problems.append(f"{block.where}: marked illustrative but executed by EXECUTED: drop one")
        elif block.mark is None and entry is None:
            problems.append(
                f"{block.where}: a {block.language} block neither executed (add it to EXECUTED in "
                "tests/test_doc_snippets.py) nor marked <!-- illustrative: why --> on the line before the fence"
            )
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_docs_block_is_executed_or_marked(path):
    problems = _problems(path)
    assert not problems, "\n".join(problems)


def test_every_readme_block_is_executed_or_marked():
    problems = _problems(README)
    assert not problems, "\n".join(problems)


def test_every_executed_entry_matches_a_block():
    for run in EXECUTED:
        matching = [b for b in blocks(ROOT / run.file) if run.contains in b.code]
        assert len(matching) == 1, (
            f"EXECUTED entry {run.file} {run.contains!r} matches {len(matching)} blocks"
        )


def _executed_blocks() -> list[tuple[Block, Run]]:
    pairs = []
    for path in [*DOCS, README]:
        for block in blocks(path):
            entry = _entry(block) if block.language else None
            if entry is not None and block.mark is None:
                pairs.append((block, entry))
    return pairs


def _commands(code: str) -> list[list[str]]:
    """Each command line of a shell block as argv: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def _tessera_argv(argv: list[str]) -> list[str] | None:
    return argv[1:] if argv and Path(argv[0]).name == "tessera" else None


def _prepared(block: Block, run: Run, folder: Path) -> str:
    code = block.code
    for old, new in run.replace.items():
        assert old in code, f"{block.where}: replacement {old!r} not in the block"
        code = code.replace(old, new.replace("TMP", str(folder / "tmp")))
    return code


# Python blocks run in one fresh interpreter, each in its own namespace and folder: as a
# reader runs them (nothing imported but what the block imports), and away from the modules
# and state the rest of the suite leaves in this process.
RUNNER = """
import json, os, sys, traceback
jobs, results = json.load(open(sys.argv[1])), {}
for job in jobs:
    os.chdir(job["cwd"])
    namespace = {"__name__": "__doc_snippet__"}
    try:
        exec(compile(job["prelude"], job["where"] + " (prelude)", "exec"), namespace)
        exec(compile(job["code"], job["where"], "exec"), namespace)
        results[job["where"]] = None
    except BaseException:
        results[job["where"]] = traceback.format_exc()
json.dump(results, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def python_results(tmp_path_factory) -> dict[str, str | None]:
    """{where: None if the block ran, else its traceback}, for every executed Python block."""
    root = tmp_path_factory.mktemp("snippets")
    jobs = []
    for i, (block, run) in enumerate(_executed_blocks()):
        if block.language != "python" or run.same_as is not None:
            continue
        folder = root / str(i)
        (folder / "tmp").mkdir(parents=True)
        code = _prepared(block, run, folder)
        jobs.append({"where": block.where, "prelude": run.prelude, "code": code, "cwd": str(folder)})
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(root / "jobs.json"), str(root / "results.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a hang fails the tests; the blocks take seconds
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((root / "results.json").read_text())


@pytest.mark.parametrize(
    "block,run", _executed_blocks(), ids=lambda x: x.where if isinstance(x, Block) else ""
)
def test_executed_block_runs(block, run, tmp_path, monkeypatch, capsys, request):
    if run.same_as is not None:
        assert block.code == (ROOT / run.same_as).read_text(), f"{block.where} is not {run.same_as}"
    elif block.language == "python":
        failure = request.getfixturevalue("python_results")[block.where]
        assert failure is None, f"{block.where} failed:\n{failure}"
    else:  # tessera commands, through the command line's own entry point, in this process
        from tessera.cli import main

        (tmp_path / "tmp").mkdir()
        monkeypatch.chdir(tmp_path)  # whatever a command writes lands here
        for argv in _commands(_prepared(block, run, tmp_path)):
            args = _tessera_argv(argv)
            assert args is not None, f"{block.where}: only tessera commands run here: {shlex.join(argv)}"
            assert main(args) == 0, f"{block.where}: {shlex.join(argv)}\n{capsys.readouterr().err}"


def _shell_commands() -> list[tuple[str, list[str]]]:
    return [
        (block.where, argv)
        for path in [*DOCS, README]
        for block in blocks(path)
        if block.language == "shell"
        for argv in _commands(block.code)
    ]


def test_every_tessera_command_parses(capsys):
    """Illustrative blocks are not run, but every tessera line in any shell block must be a
    valid command line under today's flag names (an old name kept for one release fails
    here), and the example scripts they name must exist."""
    from tessera.cli import build_parser

    parser = build_parser()
    for where, argv in _shell_commands():
        for word in argv:
            if word.startswith("examples/") and word.endswith(".py"):
                assert (ROOT / word).is_file(), f"{where}: {word} does not exist"
        args = _tessera_argv(argv)
        if args is None:
            continue
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                parsed, extra = parser.parse_known_args(args)
        except SystemExit:
            pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse: {capsys.readouterr().err.strip()}")
        renamed = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        assert not renamed, f"{where}: `{shlex.join(argv)}` uses an old flag name: {'; '.join(renamed)}"
        assert not extra or parsed.command == "launch", (
            f"{where}: unknown arguments {extra} in {shlex.join(argv)}"
        )
