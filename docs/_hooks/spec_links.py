"""MkDocs hook: links of the copied specification that leave the spec set are info, not warnings.

``docs/spec/`` holds the specification exactly as written, and it links to
documents that were never part of the set (``task_lifecycle.md``,
``../c4.md`` …). MkDocs' ``validation`` levels are global (there is no
per-directory setting in MkDocs 1.6), so this hook lowers them to ``info``
while a page under ``spec/`` is rendered and restores the configured levels
for every other page: a broken link in our own pages still fails
``mkdocs build --strict``, and the spec stays unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

SPEC_DIR = "spec/"
"""Pages under this directory (relative to ``docs/``) are the copied specification ..."""
SPEC_INDEX = "spec/index.md"
"""... except this one, our page about it, whose links are checked like any other."""

# The link checks that run while a page renders; anchors are checked after
# all pages, with the configured level (the spec pages link to no anchors).
_LEVELS = ("not_found", "unrecognized_links")
_configured: dict[str, int] = {}


def on_config(config: Any) -> None:
    """Remember the levels configured in mkdocs.yml."""
    links = config.validation.links
    _configured.update({name: links[name] for name in _LEVELS})


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Use ``info`` for a spec page's links, the configured levels for any other page."""
    uri = page.file.src_uri
    in_spec = uri.startswith(SPEC_DIR) and uri != SPEC_INDEX
    links = config.validation.links
    for name in _LEVELS:
        links[name] = min(logging.INFO, _configured[name]) if in_spec else _configured[name]
    return markdown


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Restore the configured levels once the page's links were resolved."""
    config.validation.links.update(_configured)
    return html
