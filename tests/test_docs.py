"""The documentation: a strict MkDocs build, the README's links, the spec the code cites,
and every complete Python example of the README and of ``docs/``.

The strict build (``./dev docs``) fails on a broken relative link or anchor,
a page missing from the navigation, a nav entry without a page, and a
docstring mkdocstrings cannot read. Links inside ``docs/spec/`` (the
specification, copied unchanged) that point outside the set are reported at
info level by ``docs/_hooks/spec_links.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.spark_fixtures import TEST_JVM_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SPEC = DOCS / "spec"

# A build takes a few seconds of CPU (about half of it the API reference);
# the bound only keeps a hung build from hanging the suite.
BUILD_TIMEOUT = 300

# Markdown links and images: [text](target) or ![alt](target "title").
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SKIPPED = ("http://", "https://", "mailto:", "#")  # external, or an anchor of the page


def _build(config_dir: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run ``mkdocs build --strict`` on the ``mkdocs.yml`` in ``config_dir``."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=config_dir,
        # Material's banner about its successor says nothing about our pages.
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )


def test_docs_build_strictly(tmp_path: Path) -> None:
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    # Every nav section was written, the API reference from the docstrings included.
    reference = (tmp_path / "site" / "reference" / "trace_core" / "index.html").read_text()
    assert 'id="trace_core.TaskQueue"' in reference
    assert (tmp_path / "site" / "spec" / "interface-contracts" / "index.html").is_file()
    # The spec's links out of the set were seen, and reported at info level only.
    assert re.search(
        r"INFO\s+-\s+Doc file 'spec/interface-contracts.md' contains a link "
        r"'task_lifecycle.md'",
        done.stderr,
    ), done.stderr


def _copy_docs(tmp_path: Path) -> Path:
    """A copy of mkdocs.yml and docs/ to break on purpose, without the API reference.

    The configuration is the same (validation levels, hook, plugins); only the
    ``:::`` directives are dropped, since rendering the docstrings is most of
    a build's time and has nothing to do with links.
    """
    copy = tmp_path / "project"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(DOCS, copy / "docs")
    for page in (copy / "docs" / "reference").glob("*.md"):
        page.write_text(_DIRECTIVE.sub("", page.read_text()))
    return copy


# A mkdocstrings directive with its indented options.
_DIRECTIVE = re.compile(r"^::: .*\n(?:[ \t]+.*\n)*", flags=re.M)


# spec/index.md is our page about the spec, not part of the copied set.
@pytest.mark.parametrize("name", ["glossary.md", "spec/index.md"])
def test_a_broken_link_in_our_pages_fails_the_build(name: str, tmp_path: Path) -> None:
    copy = _copy_docs(tmp_path)
    page = copy / "docs" / name
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    done = _build(copy, tmp_path / "site")
    assert done.returncode != 0
    assert f"WARNING -  Doc file '{name}' contains a link 'no-such-page.md'" in done.stderr
    # The only warning: the copy without the API reference is otherwise clean.
    assert "Aborted with 1 warnings in strict mode" in done.stdout, done.stdout


def test_a_broken_anchor_in_our_pages_fails_the_build(tmp_path: Path) -> None:
    copy = _copy_docs(tmp_path)
    page = copy / "docs" / "glossary.md"
    page.write_text(page.read_text() + "\nSee [a section](dags.md#no-such-section).\n")
    done = _build(copy, tmp_path / "site")
    assert done.returncode != 0
    assert "'dags.md#no-such-section'" in done.stderr, done.stderr
    assert "Aborted with 1 warnings in strict mode" in done.stdout, done.stdout


def _relative_links(markdown: str) -> list[str]:
    """The link targets of a Markdown text that point into the repository."""
    # Code spans and fenced blocks hold examples, not links.
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in _LINK.findall(text) if not t.startswith(_SKIPPED)]


def test_readme_relative_links_resolve() -> None:
    links = _relative_links((ROOT / "README.md").read_text())
    assert links, "the README links into docs/"
    missing = [t for t in links if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_link_finder_sees_links_and_skips_code() -> None:
    text = '[a](docs/a.md) ![i](img.png "t") [x](https://x.org) [s](#top)\n`[c](c.md)`\n'
    assert _relative_links(text) == ["docs/a.md", "img.png"]


# The spec files the code's docstrings and comments cite by name.
_CITATION = re.compile(
    r"\b(interface-contracts|dispatcher|euterpe-contract|worker-control-plane-v1"
    r"|orchestration-data-model)\.md|\bSECURITY-NOTES\b"
)


def test_every_spec_file_the_code_cites_is_in_docs_spec() -> None:
    cited: set[str] = set()
    for package in ("trace_core", "trace_lite", "trace_aws"):
        for path in (ROOT / package).rglob("*.py"):
            for match in _CITATION.finditer(path.read_text()):
                cited.add(f"{match.group(1)}.md" if match.group(1) else "SECURITY-NOTES.md")
    assert {"interface-contracts.md", "dispatcher.md", "SECURITY-NOTES.md"} <= cited
    missing = sorted(name for name in cited if not (SPEC / name).is_file())
    assert not missing, f"cited but not in docs/spec/: {missing}"


def _python_examples() -> list[tuple[str, str]]:
    """Blocks fenced ```python are complete programs and must run; fragments use ```py."""
    pages = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if SPEC not in p.parents)]
    examples = []
    for page in pages:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
        examples += [(f"{page.relative_to(ROOT)}#{i}", code) for i, code in enumerate(blocks)]
    return examples


EXAMPLES = _python_examples()


Ran = tuple[subprocess.CompletedProcess[str], Path]


@pytest.fixture(scope="session")
def run_example(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Ran]:
    """Runs an example once per test process, in a directory of its own (two
    tests read the Dispatcher example's output): its result and the directory."""
    ran: dict[str, Ran] = {}

    def run(code: str) -> Ran:
        if code not in ran:
            cwd = tmp_path_factory.mktemp("example")
            # An example that starts Spark gets the tests' JVM flags (the docs
            # show the product's defaults; the JVM says so on stderr).
            env = {**os.environ, "JAVA_TOOL_OPTIONS": TEST_JVM_OPTIONS}
            done = subprocess.run(
                [sys.executable, "-c", code],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=300,
                env=env,
            )
            ran[code] = (done, cwd)
        return ran[code]

    return run


@pytest.mark.parametrize(("where", "code"), EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_python_examples_run(where: str, code: str, run_example: Callable[[str], Ran]) -> None:
    done, cwd = run_example(code)
    assert done.returncode == 0, f"{where}: {done.stderr}"
    assert list(cwd.glob("*.db")), f"{where}: each example works on a SQLite file"


def test_the_examples_include_the_three_programs() -> None:
    # The task queue, the Dispatcher and the embedded lite platform.
    assert any("TaskQueue(" in code for _, code in EXAMPLES)
    assert any("Dispatcher(" in code for _, code in EXAMPLES)
    assert any("TraceLite(" in code for _, code in EXAMPLES)


def test_dispatcher_example_routes_each_unit_once(run_example: Callable[[str], Ran]) -> None:
    [code] = [code for _, code in EXAMPLES if "Dispatcher(" in code]
    done, _ = run_example(code)
    assert done.returncode == 0, done.stderr
    assert sorted(re.findall(r"doubling cursor (\d+)", done.stdout)) == ["1", "2", "3"]
    assert "hello/double" in done.stdout and "tasks: Completed 3" in done.stdout
