"""The mode registry is the one list of modes: every mode is a package declaring itself, the rest of specbuild asks
the registry, and nothing outside specbuild/plugins names a mode."""

import subprocess
import sys
import tokenize
from pathlib import Path

from click.testing import CliRunner

import specbuild
from specbuild.modes import registry
from specbuild.modes.spec import FAMILIES

ROOT = Path(specbuild.__file__).parent


def test_every_mode_is_a_package_whose_references_resolve():
    modes = registry.modes()
    # one line per mode; a package is its mode name as a Python identifier (draft-target: draft_target)
    assert [m.replace("-", "_") for m in modes] == [p.rsplit(".", 1)[1] for p in registry.MODE_PACKAGES]
    assert sum(spec.baseline for spec in modes.values()) == 1
    for name, spec in modes.items():
        assert (ROOT / "plugins" / name.replace("-", "_") / "__init__.py").is_file()
        assert spec.family in FAMILIES
        refs = [spec.graph_plugin, spec.drafter, spec.converter, spec.trainer]
        for ref in filter(None, refs):
            assert callable(registry.load_object(ref)), ref


def test_mode_packages_and_drafters_import_without_torch():
    code = (
        "import sys\n"
        "from specbuild.modes import registry\n"
        "for spec in registry.modes().values(): registry.load_object(spec.drafter)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('specbuild.builder'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)


def _string_literals(path: Path):
    with path.open("rb") as fh:
        for tok in tokenize.tokenize(fh.readline):
            if tok.type == tokenize.STRING:
                yield tok.start[0], tok.string


# literals that spell a mode's name but mean something else: (file under specbuild/, the word)
NOT_MODE_NAMES = {("serve/openai_schema.py", "suffix")}  # OpenAI's completions parameter `suffix`


def test_no_mode_name_literal_outside_the_plugins():
    names = set(registry.mode_names())
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if (ROOT / "plugins") in path.parents:
            continue
        for line, literal in _string_literals(path):
            body = literal.lstrip("rbuRBU").strip("'\"")
            if body in names and (path.relative_to(ROOT).as_posix(), body) not in NOT_MODE_NAMES:
                found.append(f"{path.relative_to(ROOT.parent)}:{line}: {literal}")
    assert not found, "mode names outside specbuild/plugins:\n" + "\n".join(found)


def test_the_cli_derives_modes_and_their_options_from_the_registry():
    from specbuild.cli.main import cli

    build_help = CliRunner().invoke(cli, ["build", "--help"], terminal_width=200).output
    convert_help = CliRunner().invoke(cli, ["convert", "--help"], terminal_width=200).output
    for name, spec in registry.modes().items():
        assert name in build_help
        for option in spec.options:
            assert option.flag in build_help
        if spec.converter:
            assert spec.head_option in convert_help


def test_unknown_mode_is_one_line_naming_the_known_ones():
    import pytest

    from specbuild.errors import SpecbuildError

    with pytest.raises(SpecbuildError, match=r"--speculative-mode 'jacobi' is not one of none, medusa"):
        registry.get_mode("jacobi")
