"""Griffe extension for the API reference: gradsync's docstrings cross-reference with Sphinx roles
(:func:`build_hook`, :class:`~gradsync.algorithms.covap.CovapState`), which Markdown would print verbatim.
Each role becomes inline code of its target (the last component only for a ``~`` target, as Sphinx shows it).
Loaded by mkdocs.yml (mkdocstrings ``extensions``); not part of the site (``exclude_docs``)."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def strip_roles(text: str) -> str:
    """``text`` with every Sphinx cross-reference role replaced by inline code of its target."""
    return ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = strip_roles(obj.docstring.value)
