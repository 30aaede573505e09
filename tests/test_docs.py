"""The documentation site builds in strict mode, as `make docs` builds it: a broken link or
anchor, a page left out of the navigation, or an API reference (mkdocstrings ``:::``) that
no longer resolves fails the suite, and so CI."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "NO_MKDOCS_2_WARNING": "1",
}  # Material's notice about its successor, not a warning of ours


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    result = _build(ROOT / "mkdocs.yml", site)
    assert result.returncode == 0, result.stderr[-4000:]
    # the pages the hook generates from benchmarks/results, with their plots
    results = sorted(p.stem for p in (ROOT / "benchmarks" / "results").glob("*.md"))
    for name in results:
        assert (site / "results" / name / "index.html").is_file(), name
        if (ROOT / "benchmarks" / "results" / f"{name}.png").is_file():
            assert (site / "results" / f"{name}.png").is_file(), name
    # the API reference rendered every object named on it
    api = (site / "api" / "index.html").read_text()
    for line in (ROOT / "docs" / "api.md").read_text().splitlines():
        if line.startswith("::: "):
            assert f'id="{line[4:].strip()}"' in api, line


def test_strict_mode_fails_on_a_broken_link(tmp_path):
    """The site's own validation settings turn a link to a missing page or anchor into a
    failed build (checked on a two-page site with the built-in theme: seconds, not the
    whole site)."""
    ours = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(
        "# Home\n\nSee [the other page](other.md#no-such-heading) and [gone](gone.md).\n"
    )
    (docs / "other.md").write_text("# Other\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        textwrap.dedent(
            f"""\
            site_name: check
            theme: mkdocs
            validation: {ours["validation"]}
            nav: [index.md, other.md]
            """
        )
    )
    result = _build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "gone.md" in result.stderr and "no-such-heading" in result.stderr, result.stderr[-2000:]
