"""The command line answers `--help` and a typo without importing the heavy libraries: every
verb's parser is built from light modules, and the handlers import what they use (issue 29)."""

import json
import subprocess
import sys

# Run in a fresh interpreter: this test session has long imported torch itself.
PROBE = r"""
import argparse, contextlib, io, json, sys
import tessera.cli

def paths(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if name != "launch":  # its flags are torchrun's own: parsed by torch on use
                    yield (*prefix, name)
                    yield from paths(sub, (*prefix, name))

codes = {}
for argv in [["--help"], ["trian"]] + [[*p, "--help"] for p in paths(tessera.cli.build_parser())]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            tessera.cli.main(argv)
        except SystemExit as exc:
            codes[" ".join(argv)] = exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "diffusers", "numpy"))
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_help_and_typos_import_no_heavy_library():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["heavy"] == []
    codes = report["codes"]
    assert codes.pop("trian") == 2  # argparse's own usage error
    assert len(codes) > 15 and set(codes.values()) == {0}, codes  # every verb's --help
