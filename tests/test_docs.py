"""The documentation holds together: every relative link in README.md and docs/ resolves (anchors included, by
GitHub's heading slugs), every `specbuild` command and every mode of the registry is documented, the README stays a
front page, and no tracked file points outside the repository. Each check is a function of its inputs, and a test
feeds each one something broken to see it reported."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCHMARK_LOGS = DOCS / "benchmarks"
MODES_PAGE = DOCS / "modes.md"
README_MAX_LINES = 200
README_MAX_WIDTH = 120  # table rows may be a little longer
OUTSIDE_NEEDLE = "../" + "shared"  # built here so that this file does not match itself

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target), the target up to whitespace or ")" (an optional "title" after it)
INLINE_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (links as their text, no markup), lower-cased, punctuation
    dropped except hyphens and underscores, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        if slug in seen:
            seen[slug] += 1
            slug = f"{slug}-{seen[slug]}"
        else:
            seen[slug] = 0
        out.add(slug)
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline or reference link outside code."""
    out = []
    for number, line in prose_lines(text):
        line = INLINE_CODE.sub("", line)
        out += [(number, m.group(1)) for m in INLINE_LINK.finditer(line)]
        reference = REFERENCE_LINK.match(line)
        if reference:
            out.append((number, reference.group(1)))
    return out


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """One line per relative link that names no existing file, or an anchor no heading of its page has."""
    problems = []
    for page in files:
        text = page.read_text(encoding="utf-8")
        for number, target in links(text):
            if SCHEME.match(target) or target.startswith("//"):
                continue  # an external address
            path, _, anchor = target.partition("#")
            where = f"{page.relative_to(root)}:{number}: {target}"
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                problems.append(f"{where}: no such file")
                continue
            if anchor and resolved.suffix == ".md" and resolved.is_file():
                if anchor not in anchors(resolved.read_text(encoding="utf-8")):
                    problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


def cli_commands() -> list[str]:
    """Every `specbuild` command line: each command of the click group, and each subcommand of its groups."""
    import click

    from specbuild.cli.main import cli

    names = []
    for name, command in cli.commands.items():
        names.append(name)
        if isinstance(command, click.Group):
            names += [f"{name} {sub}" for sub in command.commands]
    return names


def reference_pages() -> list[Path]:
    """The docs pages other than the benchmark logs."""
    return sorted(p for p in DOCS.rglob("*.md") if BENCHMARK_LOGS not in p.parents)


def undocumented(commands: list[str], texts: list[str]) -> list[str]:
    """The commands for which no text says `specbuild <command>`."""
    return [
        name
        for name in commands
        if not any(re.search(r"specbuild " + re.escape(name) + r"(?![\w-])", text) for text in texts)
    ]


def modes_without_section(names, text: str) -> list[str]:
    """The modes no heading of `text` names in backticks (e.g. "## `eagle3`")."""
    headings = [m.group(2) for _, line in prose_lines(text) if (m := HEADING.match(line))]
    return [name for name in names if not any(f"`{name}`" in heading for heading in headings)]


def front_page_problems(text: str) -> list[str]:
    """What keeps a README from being a front page: too many lines, or lines other than table rows too wide."""
    lines = text.splitlines()
    problems = [f"{len(lines)} lines (at most {README_MAX_LINES})"] if len(lines) > README_MAX_LINES else []
    return problems + [
        f"line {number} has {len(line)} characters (at most {README_MAX_WIDTH})"
        for number, line in enumerate(lines, 1)
        if len(line) > README_MAX_WIDTH and not line.lstrip().startswith("|")
    ]


def files_containing(paths: list[Path], needle: str) -> list[str]:
    data = needle.encode()
    return [str(p) for p in paths if p.is_file() and data in p.read_bytes()]


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed.split("\0") if name]


ARCHITECTURE = DOCS / "architecture.md"
PACKAGE = ROOT / "specbuild"
PY_FILE = re.compile(r"`((?:[\w<>-]+/)*[\w<>-]+\.py)`")
HEADER = re.compile(r"^\*\*`(specbuild/(?:[\w<>-]+/)*)`\*\*")
CITED_NAME = re.compile(r"`([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)(?:\(\))?`")


def section(text: str, heading: str) -> str:
    """The lines of `text` from `## heading` to the next heading of that level."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def code_map(text: str, package: Path) -> tuple[set[Path], list[str]]:
    """(the modules the code map names, the files it cites that do not exist). Each paragraph that starts with a
    bold package path names files relative to that package: `x.py` or `sub/x.py` is every module under the package
    whose path ends so (`<mode>` stands for any directory), a path from `specbuild/` is itself."""
    modules = [p for p in package.rglob("*.py") if "__pycache__" not in p.parts]
    named, missing = set(), []
    for paragraph in re.split(r"\n\s*\n", section(text, "Code map")):
        header = HEADER.match(paragraph.strip())
        if header is None:
            continue
        base = package.parent / header.group(1).partition("<mode>/")[0]  # <mode>/: every mode's package
        for cited in PY_FILE.findall(paragraph):
            root = package.parent if cited.startswith("specbuild/") else base
            cited = f"<mode>/{cited}" if header.group(1).endswith("<mode>/") and "/" not in cited else cited
            pattern = re.compile("(^|/)" + re.escape(cited).replace(re.escape("<mode>"), r"\w+") + "$")
            found = {p for p in modules if p.is_relative_to(root) and pattern.search(p.relative_to(root).as_posix())}
            if not found:
                missing.append(f"{cited} (under {root.relative_to(package.parent)})")
            named |= found
    return named, missing


def unnamed_modules(text: str, package: Path) -> list[str]:
    """The modules (but packages' __init__.py) the code map names in no paragraph, and the files it cites that do
    not exist."""
    named, missing = code_map(text, package)
    modules = [p for p in package.rglob("*.py") if "__pycache__" not in p.parts and p.name != "__init__.py"]
    return [f"not in the code map: {p.relative_to(package.parent)}" for p in sorted(set(modules) - named)] + [
        f"cited, no such file: {m}" for m in missing
    ]


def defined_names(package: Path) -> set[str]:
    """Every name the package defines: modules, classes, functions, assigned and annotated names, attributes set."""
    import ast

    names = set()
    for path in package.rglob("*.py"):
        names |= {path.stem, path.parent.name}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def unknown_names(text: str, names: set[str]) -> list[str]:
    """Names the page cites in code spans that the package does not define: each part of a dotted name
    (`plan.resolve`), and every plain name written as code (`write_engine`, `LlamaNetwork`) but lower-case words
    without an underscore (`none`, `tree`: modes and fields, not Python names)."""
    out = []
    for _, line in prose_lines(text):
        for cited in CITED_NAME.findall(line):
            parts = cited.split(".")
            if len(parts) == 1 and cited.islower() and "_" not in cited:
                continue
            if len(parts) > 1 and parts[-1] in ("py", "md", "yaml", "json", "onnx", "bin", "sh"):
                continue  # a file name
            out += [f"{cited}: {part}" for part in parts if part not in names]
    return sorted(set(out))


# ---------------------------------------------------------------- the checks


def test_the_code_map_names_every_module_and_cites_only_what_exists():
    assert unnamed_modules(ARCHITECTURE.read_text(encoding="utf-8"), PACKAGE) == []


def test_every_name_the_architecture_page_cites_exists():
    names = defined_names(PACKAGE) | defined_names(ROOT / "tests")  # the page cites the tests' fixtures too
    assert unknown_names(ARCHITECTURE.read_text(encoding="utf-8"), names) == []


def test_the_code_map_check_sees_a_module_without_a_line_and_a_name_that_is_gone(tmp_path):
    package = tmp_path / "specbuild"
    (package / "runtime").mkdir(parents=True)
    for name in ("__init__.py", "runtime/__init__.py", "runtime/engine.py", "runtime/new_module.py", "tree.py"):
        (package / name).write_text("def generate():\n    pass\n")
    page = (
        "## Code map\n\n**`specbuild/runtime/`**: `engine.py` (`Engine.generate`), `gone.py`.\n\n"
        "**`specbuild/`** at the top: `tree.py`.\n\n## Next\n"
    )
    assert unnamed_modules(page, package) == [
        "not in the code map: specbuild/runtime/new_module.py",
        "cited, no such file: gone.py (under specbuild/runtime)",
    ]
    assert unknown_names(page, defined_names(package)) == ["Engine.generate: Engine"]


def test_every_relative_link_resolves():
    assert not broken_links(markdown_files())


def test_every_command_is_documented_in_the_reference_pages():
    texts = [p.read_text(encoding="utf-8") for p in reference_pages()]
    commands = cli_commands()
    assert {"build", "triton-repo", "corpus grow"} <= set(commands)
    assert not undocumented(commands, texts)


def test_every_mode_has_a_section_in_the_modes_page():
    from specbuild.modes.registry import modes

    assert not modes_without_section(list(modes()), MODES_PAGE.read_text(encoding="utf-8"))


def test_the_readme_is_a_front_page():
    assert not front_page_problems(README.read_text(encoding="utf-8"))


def test_no_tracked_file_points_outside_the_repository():
    assert not files_containing(tracked_files(), OUTSIDE_NEEDLE)


# ---------------------------------------------------------------- each check can fail


def test_the_checks_report_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## `eagle3` and more\n\n## Setting it up, offline\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Title\n\n"
        "[fine](docs/page.md) [fine anchor](docs/page.md#setting-it-up-offline) [own](#title) [web](https://x.org/a)\n"
        "[missing](docs/nothing.md) [bad anchor](docs/page.md#no-such-heading)\n"
        "`[in code](docs/not-checked.md)`\n"
        "```\n[fenced](docs/not-checked-either.md)\n```\n"
        "[ref]: docs/gone.md\n"
    )
    problems = broken_links([readme], root=tmp_path)
    assert len(problems) == 3, problems
    assert "README.md:4: docs/nothing.md: no such file" in problems
    assert "README.md:4: docs/page.md#no-such-heading: no heading with anchor #no-such-heading" in problems
    assert "README.md:9: docs/gone.md: no such file" in problems

    pages = ["`specbuild run --engine-dir e`", "specbuild corpus"]
    assert undocumented(["run", "triton-repo", "corpus grow"], pages) == ["triton-repo", "corpus grow"]
    assert undocumented(["run"], ["specbuild running"]) == ["run"]
    page = (tmp_path / "docs" / "page.md").read_text()
    assert modes_without_section(["eagle3", "eagle", "ngram"], page) == ["eagle", "ngram"]

    long_readme = "# Title\n" + "x" * (README_MAX_WIDTH + 1) + "\n| " + "y" * 200 + " |\n" + "line\n" * README_MAX_LINES
    assert front_page_problems(long_readme) == [
        f"{README_MAX_LINES + 3} lines (at most {README_MAX_LINES})",
        f"line 2 has {README_MAX_WIDTH + 1} characters (at most {README_MAX_WIDTH})",
    ]
    assert front_page_problems("# Title\n\nshort\n") == []

    leaky = tmp_path / "leaky.txt"
    leaky.write_text(f"see {OUTSIDE_NEEDLE}/notes.md\n")
    assert files_containing([leaky, readme], OUTSIDE_NEEDLE) == [str(leaky)]


def test_github_slugs():
    assert github_slug("`eagle3`: EAGLE-3 heads") == "eagle3-eagle-3-heads"
    assert github_slug("Exactness on CPUs (int8 activations)") == "exactness-on-cpus-int8-activations"
    assert github_slug("`draft-target` [link](x.md)") == "draft-target-link"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
