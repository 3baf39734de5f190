"""The documentation: the README stays page one (short, the quick start CI runs), and the MkDocs
site builds with `--strict`, where a broken link or anchor anywhere (docs/, the README, the
repository files they link) is a warning and fails the build. The link mechanism
(tools/mkdocs_hooks.py) is checked on a small repository of its own, a broken link included.
The page checks are `unit`; the two builds (MkDocs, about 10 s together) are `slow`."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "tools" / "mkdocs_hooks.py"


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.unit
def test_the_readme_is_page_one_with_the_quick_start_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert ("```bash\nmake demo   # sets everything up on first use, then runs the end-to-end demo\n"
            "make test   # sets everything up on first use, then runs every test tier\n```") in readme
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert "helm install moonlease charts/moonlease" in readme
    assert "kind: MooncakeLeasePolicy" in readme


@pytest.mark.unit
def test_no_tracker_numbers_in_user_facing_docs() -> None:
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text()
        assert not re.search(r"\b[Ii]ssues? \d+|\bseed issue|(?<![\w&])#\d+\b", text), page


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    # Repository files the pages link are in the site, where the rewritten links point.
    assert (tmp_path / "site" / "repo" / "examples" / "policies" / "ab-selective.yaml").is_file()
    assert 'href="../repo/examples/policies/ab-selective.yaml"' in (tmp_path / "site" / "ab-testing" / "index.html").read_text()


def small_repo(root: Path, index: str) -> Path:
    (root / "docs").mkdir(parents=True)
    (root / "examples").mkdir()
    (root / "results").mkdir()
    (root / "examples" / "a.yaml").write_text("kind: Example\n")
    (root / "results" / "r.md").write_text("# Results\n\n![plot](r.png) and [the docs](../docs/index.md#home)\n")
    (root / "results" / "r.png").write_bytes(b"\x89PNG\r\n")
    (root / "results" / "unlinked.md").write_text("# Never linked\n")
    (root / "docs" / "index.md").write_text(textwrap.dedent(index))
    config = root / "mkdocs.yml"
    config.write_text(textwrap.dedent(f"""\
        site_name: t
        hooks: [{HOOK}]
        validation:
          links: {{not_found: warn, anchors: warn, unrecognized_links: warn, absolute_links: warn}}
        """))
    return config


@pytest.mark.slow
def test_links_to_repository_files_resolve_in_the_site_and_a_broken_one_fails(tmp_path: Path) -> None:
    good = """\
        # Home

        [example](../examples/a.yaml), [results](../results/r.md) and `](../not/a/link)` in code:

        ```
        [inside a fence](../missing.md) [shown as written](../examples/a.yaml)
        ```
        """
    done = build(small_repo(tmp_path / "good", good), tmp_path / "good-site")
    assert done.returncode == 0, done.stderr
    site = tmp_path / "good-site"
    assert (site / "repo" / "examples" / "a.yaml").read_text() == "kind: Example\n"
    assert (site / "repo" / "results" / "r.png").is_file()  # reached through r.md's own link
    assert not (site / "repo" / "results" / "unlinked").exists()  # only what links reach
    index = (site / "index.html").read_text()
    assert 'href="repo/results/r/"' in index
    assert "[shown as written](../examples/a.yaml)" in index  # code is not rewritten
    assert 'href="../../../#home"' in (site / "repo" / "results" / "r" / "index.html").read_text()

    broken = good + "[gone](../examples/missing.yaml)\n"
    done = build(small_repo(tmp_path / "broken", broken), tmp_path / "broken-site")
    assert done.returncode != 0
    assert "../examples/missing.yaml" in done.stderr
