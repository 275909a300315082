"""Check the user documentation: every `mlxmtp serve` option is a row of the README's options
table (and every row an option), and every relative link in README.md, BENCHMARKS.md,
docs/*.md and the demo model's card points to an existing file (and heading, for `#anchor`
links).

    python scripts/check_docs.py        # exit status 1 on any problem, each printed
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent


def table_flags(readme: str) -> set:
    section = readme.split("## `serve` options", 1)[1].split("\n## ", 1)[0]
    flags = set()
    for row in section.splitlines():
        if row.startswith("| `"):
            flags |= set(re.findall(r"--[a-z0-9-]+", row.split("|")[1]))
    return flags


def serve_flags() -> set:
    from mlxmtp.commands.serve import serve

    flags = set()
    for param in serve.params:
        if not getattr(param, "hidden", False):
            flags |= {o for o in [*param.opts, *param.secondary_opts] if o.startswith("--")}
    return flags - {"--help"}


def anchors(markdown: str) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+ (.*)$", markdown, flags=re.M)}


def link_problems(path: Path) -> list:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    problems = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file)).resolve() if file else path
        if not dest.exists():
            problems.append(f"{path.relative_to(ROOT)}: broken link {target}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{path.relative_to(ROOT)}: no heading for {target}")
    return problems


def main() -> int:
    problems = []
    in_table, options = table_flags((ROOT / "README.md").read_text()), serve_flags()
    problems += [f"README.md: serve option {f} missing from the options table" for f in sorted(options - in_table)]
    problems += [f"README.md: {f} in the options table is no serve option" for f in sorted(in_table - options)]
    for path in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
                 ROOT / "mlxmtp/demo_model/README.md"]:
        problems += link_problems(path)
    print("\n".join(problems) or "docs: options table and links OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
