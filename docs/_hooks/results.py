"""MkDocs hook: the committed benchmark results become pages of the site.

`tessera bench NAME` writes benchmarks/results/NAME.md (a table) and NAME.png (a plot) beside
its JSON, outside docs/. Each NAME.md becomes the page results/NAME.md with its plot below
it, and demo.txt (the committed `make demo` run) the page results/demo.md, generated at
build time so the site always shows the committed files and nothing is copied by hand.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files: Files, config) -> Files:
    for table in sorted(RESULTS.glob("*.md")):
        name = table.stem
        text = table.read_text()
        plot = RESULTS / f"{name}.png"
        if plot.exists():
            files.append(File.generated(config, f"results/{name}.png", abs_src_path=str(plot)))
            text += f"\n\n![{name}]({name}.png)\n"
        source = f"\n\nSource: `benchmarks/results/{name}.md` and `{name}.json`, written by `tessera bench {name}`.\n"
        files.append(File.generated(config, f"results/{name}.md", content=text + source))
    demo = RESULTS / "demo.txt"
    if demo.exists():
        page = "# demo\n\nThe committed `make demo` run (`benchmarks/results/demo.txt`):\n\n"
        page += "```text\n" + demo.read_text().rstrip("\n") + "\n```\n"
        files.append(File.generated(config, "results/demo.md", content=page))
    return files
