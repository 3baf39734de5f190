"""MkDocs hook: pages in docs/ link repository files outside it (`../examples/...`,
`../benchmarks/results/...`) with ordinary relative links, which also work when the Markdown
is read on a forge; the built site has no such files, so this hook puts every file those links
reach (and, for Markdown files, what their own links reach, transitively) into the site under
`repo/<path in the repository>`, and rewrites the links to point there before MkDocs validates
them. Links from a mirrored file back into docs/ (the README's, say) point at the site's pages.
A link to a repository file that does not exist, or to a folder, is left as written, so MkDocs
reports it and `mkdocs build --strict` fails.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

MIRROR = "repo"  # where repository files live in the site
# An inline link or image target: `](target)` or `](target "title")`.
_LINK = re.compile(r"\]\((?P<target>[^)\s#]*)(?P<rest>[^)\s]*(?:\s+\"[^\"]*\")?)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _repo_root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _docs_prefix(config: MkDocsConfig) -> str:
    return Path(config.docs_dir).resolve().relative_to(_repo_root(config)).as_posix()


def _repo_path(src_uri: str, docs_prefix: str) -> str:
    """The repository path of a site file: a mirrored one, or one of docs/."""
    if src_uri.startswith(MIRROR + "/"):
        return src_uri[len(MIRROR) + 1:]
    return f"{docs_prefix}/{src_uri}"


def _site_uri(repo_path: str, docs_prefix: str) -> str:
    if repo_path.startswith(docs_prefix + "/"):
        return repo_path[len(docs_prefix) + 1:]
    return f"{MIRROR}/{repo_path}"


def _targets(markdown: str) -> list[str]:
    """Relative link targets outside fenced code blocks (no scheme, no absolute path, no anchor-only)."""
    prose = _FENCE.sub("", markdown)
    return [t for m in _LINK.finditer(prose)
            if (t := m.group("target")) and not re.match(r"[a-zA-Z][\w+.-]*:", t) and not t.startswith("/")]


def _resolve(page_repo_path: str, target: str) -> str:
    return posixpath.normpath(posixpath.join(posixpath.dirname(page_repo_path), target))


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root, docs = _repo_root(config), _docs_prefix(config)
    queue = [f for f in files.documentation_pages()]
    while queue:
        page = queue.pop()
        page_path = _repo_path(page.src_uri, docs)
        for target in _targets(Path(page.abs_src_path).read_text(encoding="utf-8")):
            path = _resolve(page_path, target)
            if path.startswith("../") or path.startswith(docs + "/") or not (root / path).is_file():
                continue  # outside the repository, a docs page, or missing: MkDocs judges it
            uri = _site_uri(path, docs)
            if files.get_file_from_path(uri) is None:
                added = File.generated(config, uri, abs_src_path=str(root / path),
                                       inclusion=InclusionLevel.NOT_IN_NAV)
                files.append(added)
                if added.is_documentation_page():
                    queue.append(added)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Rewrite each link to a repository file to where that file is in the site."""
    root, docs = _repo_root(config), _docs_prefix(config)
    page_path = _repo_path(page.file.src_uri, docs)

    def rewrite(match: re.Match[str]) -> str:
        target = match.group("target")
        if not _targets(f"]({target})"):
            return match.group(0)  # a URL, an absolute path or an anchor alone
        path = _resolve(page_path, target)
        if path.startswith("../") or not (root / path).is_file():
            return match.group(0)
        uri = posixpath.relpath(_site_uri(path, docs), posixpath.dirname(page.file.src_uri) or ".")
        return f"]({uri}{match.group('rest')})"

    # Fenced code shows links as written: rewrite only the prose between fences.
    out, last = [], 0
    for fence in _FENCE.finditer(markdown):
        out += [_LINK.sub(rewrite, markdown[last:fence.start()]), fence.group(0)]
        last = fence.end()
    return "".join(out) + _LINK.sub(rewrite, markdown[last:])
