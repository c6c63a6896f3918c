"""The README is the front door and docs/ the house behind it: every shell command they show names a
real make target, `grpo-jobs` command or script; every link of the README lands; the settings page
is what `grpo-jobs settings` prints. (`make docs` checks the links inside docs/ with mkdocs --strict.)"""

import re
import shlex
from pathlib import Path

import click
import pytest

from service.cli import main
from service.core.settings import settings_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)


def commands(text: str) -> list[list[str]]:
    """Each command of the page's shell blocks as words: comments dropped, continuations joined, and
    `a && b`, `a | b`, `a; b` and `$(a)` split into their commands."""
    found = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line).strip()
            for part in re.split(r"&&|\|\||[|;]|\$\(|\)", line):
                try:
                    words = shlex.split(part)
                except ValueError:  # an unbalanced quote across a split: take the words as they are
                    words = part.split()
                if words:
                    found.append(words)
    return found


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))


def resolves(words: list[str]) -> bool:
    """`grpo-jobs a b ...`: `a` is a command of the CLI and, where `a` is a group, `b` one of its own."""
    cmd: click.Command = main
    for word in words:
        if not isinstance(cmd, click.Group) or word.startswith("-"):
            return True
        sub = cmd.commands.get(word)
        if sub is None:
            return False
        cmd = sub
    return not isinstance(cmd, click.Group)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shell_command_names_something_real(page):
    targets, bad = make_targets(), []
    for words in commands(page.read_text()):
        for i, word in enumerate(words):
            if word == "make":
                bad += [f"make {t}" for t in words[i + 1:] if "=" not in t and not t.startswith("-")
                        and t not in targets]
            elif word.endswith("grpo-jobs") and not resolves(words[i + 1:]):
                bad.append(" ".join(words[i:i + 3]))
            elif word.endswith(".py") and "/" in word and not (ROOT / word).exists():
                bad.append(word)
    assert not bad, f"{page.name} shows commands that do not exist: {bad}"


def test_the_checker_catches_what_does_not_exist():
    text = "```bash\nmake demo && make nope\ngrpo-jobs files upload x  # fine\ngrpo-jobs files frobnicate\n" \
           "python bench/nope.py\n```\n"
    words = commands(text)
    assert ["make", "nope"] in words and ["python", "bench/nope.py"] in words
    assert resolves(["files", "upload", "x"]) and not resolves(["files", "frobnicate"]) and not resolves(["files"])
    assert "nope" not in make_targets() and {"demo", "dev", "test", "docs"} <= make_targets()


def test_the_readme_is_a_front_door_whose_links_land():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", text))
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")} - {"docs/index.md"}
    assert pages <= linked, f"pages the README does not lead to: {sorted(pages - linked)}"


def test_the_settings_page_is_what_grpo_jobs_settings_prints():
    assert settings_table() in (ROOT / "docs" / "operations" / "settings.md").read_text(), \
        "docs/operations/settings.md is stale: paste the output of `grpo-jobs settings` into it"
