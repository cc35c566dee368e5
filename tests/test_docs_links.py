"""Every relative link and #anchor in the project's Markdown resolves, as GitHub renders it.

Links are read by a CommonMark parser (markdown-it-py), so code blocks and inline code are not taken
for links and reference-style links are resolved. A relative link must name a file or folder that is
in the repository (tracked, or new and not ignored: what a commit would carry). An anchor must be the
id GitHub gives a heading of the target file: the heading's text, lower-cased, with punctuation removed
and each space turned into a hyphen, and -1, -2, ... added to repeats; or an explicit HTML id/name.
"""
from __future__ import annotations

import re
import subprocess
import unicodedata
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
HTML_ANCHOR = re.compile(r"""<a\s[^>]*\b(?:name|id)\s*=\s*["']([^"']+)["']""", re.I)


@lru_cache(maxsize=None)
def repository_files(root: Path = ROOT) -> frozenset[str]:
    """Paths (relative, POSIX) of the files a commit would carry, and of every folder holding one."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout (an unpacked archive): every file on disk
        files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".venv" not in p.parts]
    else:
        files = [f for f in listed.stdout.splitlines() if (root / f).exists()]  # a deleted file is still "cached"
    folders = {parent.as_posix() for f in files for parent in Path(f).parents if str(parent) != "."}
    return frozenset(files) | folders


def markdown_files(root: Path = ROOT) -> list[str]:
    return sorted(f for f in repository_files(root) if f.endswith(".md") and (root / f).is_file())


@lru_cache(maxsize=None)
def tokens(path: Path) -> list:
    return MarkdownIt("commonmark", {"html": True}).enable("table").parse(path.read_text(encoding="utf-8"))


def github_slug(text: str) -> str:
    """The id GitHub gives a heading (github-slugger): lower case; drop every character that is not a
    letter, digit, mark, connector punctuation (_), hyphen or space; each space becomes a hyphen."""
    kept = "".join(c for c in text.lower()
                   if c in "- " or unicodedata.category(c)[0] in "LNM" or unicodedata.category(c) == "Pc")
    return kept.replace(" ", "-")


def heading_text(inline) -> str:
    """A heading's text as rendered: its text and code spans, without markup, link targets or images."""
    parts = []
    for child in inline.children or []:
        if child.type in ("text", "code_inline"):
            parts.append(child.content)
        elif child.type == "softbreak":
            parts.append(" ")
    return "".join(parts).strip()


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    found, seen = set(), {}
    stream = tokens(path)
    for i, token in enumerate(stream):
        if token.type == "heading_open":
            slug = github_slug(heading_text(stream[i + 1]))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
        if token.type in ("html_block", "html_inline") or token.children:
            for piece in [token.content] + [c.content for c in token.children or [] if c.type == "html_inline"]:
                found.update(HTML_ANCHOR.findall(piece))
    return frozenset(found)


def links(path: Path) -> list[str]:
    out = []
    for token in tokens(path):
        for child in token.children or []:
            if child.type == "link_open":
                out.append(child.attrs["href"])
            elif child.type == "image":
                out.append(child.attrs["src"])
    return out


def problems(rel: str, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of a Markdown file (empty: every one resolves)."""
    found = []
    for href in links(root / rel):
        parts = urlsplit(href)
        if parts.scheme or href.startswith("//"):
            continue  # absolute URLs (http, mailto, ...) are not checked here: no network in tests
        path, anchor = unquote(parts.path), unquote(parts.fragment)
        if path:
            target = (Path(path.lstrip("/")) if path.startswith("/") else (Path(rel).parent / path))
            target_rel = "/".join(_normalise(target.parts)) or "."
            if target_rel.startswith("..") or (target_rel != "." and target_rel not in repository_files(root)):
                found.append(f"{href}: no {target_rel} in the repository")
                continue
        else:
            target_rel = rel
        if anchor and target_rel.endswith(".md") and anchor not in anchors(root / target_rel):
            found.append(f"{href}: no heading #{anchor} in {target_rel}")
    return found


def _normalise(parts: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for part in parts:
        if part == "..":
            if not out or out[-1] == "..":
                out.append("..")
            else:
                out.pop()
        elif part not in (".", ""):
            out.append(part)
    return out


def test_the_markdown_files_are_found():
    files = markdown_files()
    assert "README.md" in files and any(f.startswith("docs/") for f in files), files


@pytest.mark.parametrize("rel", markdown_files())
def test_every_relative_link_and_anchor_resolves(rel):
    assert problems(rel) == []


def test_the_checker_finds_broken_links_and_follows_githubs_anchor_rules(tmp_path):
    assert github_slug("Module store and zero-downtime module rollouts") == "module-store-and-zero-downtime-module-rollouts"
    assert github_slug("What `tmod-serve --help` says: 1.5x (p99)!") == "what-tmod-serve---help-says-15x-p99"
    assert github_slug("Über  café_ok") == "über--café_ok"
    (tmp_path / "docs").mkdir()
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "app.py").write_text("")
    (tmp_path / "README.md").write_text("# tmod\n## Set up: `tmod-serve --help`\n", encoding="utf-8")
    (tmp_path / "docs" / "page.md").write_text(
        "# Title\n## Same\n## Same\n<a name=\"kept\"></a>\n"
        "[ok](../README.md#set-up-tmod-serve---help) [ok](#same-1) [ok](#kept) [ok](/README.md) [ok](../server/)\n"
        "[ok](page.md) [web](https://example.com/nowhere#x) `[code](missing.md)`\n\n"
        "```\n[fenced](missing.md)\n```\n"
        "[bad file](missing.md) [bad anchor](../README.md#no-such-heading) [bad local](#same-2) [escape](../../x.md)\n",
        encoding="utf-8")
    assert markdown_files(tmp_path) == ["README.md", "docs/page.md"]
    assert problems("docs/page.md", tmp_path) == [
        "missing.md: no docs/missing.md in the repository",
        "../README.md#no-such-heading: no heading #no-such-heading in README.md",
        "#same-2: no heading #same-2 in docs/page.md",
        "../../x.md: no ../x.md in the repository"]
