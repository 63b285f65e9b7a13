"""The documentation: ``mkdocs build --strict`` of docs/ (API reference generated from the docstrings by
mkdocstrings) passes with no warning, a broken reference does fail it, and the README stays a front page
(under 150 lines, every ``docs/`` page it links to exists)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install 'gradsync[docs]' (make test installs it)")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """``python -m mkdocs build --strict`` of ``config`` into ``site``; stdout and stderr together."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)


def test_mkdocs_build_strict_has_no_warning(tmp_path):
    proc = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    warnings = [line for line in proc.stdout.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0 and not warnings, proc.stdout[-6000:]
    # The API pages were generated from the docstrings, not left empty.
    api = (tmp_path / "site" / "api" / "algorithms" / "index.html").read_text()
    for name in ("gradsync.algorithms.build_hook", "gradsync.algorithms.covap.CovapState", "gradsync.algorithms.dear"):
        assert f'id="{name}"' in api, name
    assert ":class:" not in api and ":func:" not in api, "Sphinx roles left verbatim (docs/sphinx_roles.py)"
    integrations = (tmp_path / "site" / "api" / "integrations" / "index.html").read_text()
    for name in ("lightning_callback.GradsyncHook", "transformers_callback.GradsyncCallback"):
        assert f'id="gradsync.integrations.{name}"' in integrations, name


def test_broken_reference_fails_the_strict_build(tmp_path):
    """The same plugins and options on a one-page site whose page cross-references a name gradsync does not
    have: the strict build must fail, so a broken reference in docs/ fails the suite."""
    config = (ROOT / "mkdocs.yml").read_text()
    config = re.sub(r"(?ms)^nav:.*", "", config).replace("docs_dir: docs", "docs_dir: pages")
    config = config.replace("paths: [src]", f"paths: [{ROOT / 'src'}]").replace("docs/sphinx_roles.py",
                                                                            str(ROOT / "docs" / "sphinx_roles.py"))
    (tmp_path / "mkdocs.yml").write_text(config)
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "index.md").write_text("# x\n\nSee [`nothing`][gradsync.algorithms.no_such_name].\n")
    proc = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0 and "no_such_name" in proc.stdout, proc.stdout[-3000:]


def test_readme_is_a_front_page_whose_docs_links_exist():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines; the front page must stay under 150"
    assert lines[1].startswith("make demo") and lines[3].startswith("make test"), "the set-up commands come first"
    links = re.findall(r"\]\((docs/[^)#\s]+)", readme)
    assert {"docs/getting-started.md", "docs/algorithms.md", "docs/results.md"} <= set(links), links
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, f"README.md links to missing pages: {missing}"
