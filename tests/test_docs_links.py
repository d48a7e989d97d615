"""The documentation's relative links resolve: every ``[text](path)`` and
``![plot](path)`` of README.md, CHANGELOG.md and docs/*.md names a file of
the repository, and every ``#anchor`` (in the same page or another
markdown page) names one of that page's headings, as GitHub renders them."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, "README.md"),
                os.path.join(ROOT, "CHANGELOG.md")]
               + glob.glob(os.path.join(ROOT, "docs", "*.md")))
# A markdown link or image: its target up to the first space or ")".
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
  """A heading's anchor as GitHub forms it: lower case, markup and
  punctuation other than ``-`` and ``_`` dropped, spaces made ``-``."""
  text = re.sub(r"`([^`]*)`", r"\1", heading).lower()
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
  """The anchors of a page's headings (outside fenced code), a repeated
  one numbered ``-1``, ``-2``... as GitHub does."""
  found, seen, fenced = set(), {}, False
  for line in text.splitlines():
    if line.lstrip().startswith("```"):
      fenced = not fenced
      continue
    m = None if fenced else _HEADING.match(line)
    if m:
      s = slug(m.group(2))
      n = seen.get(s, 0)
      seen[s] = n + 1
      found.add(s if n == 0 else f"{s}-{n}")
  return found


def broken_links(page: str) -> list[str]:
  """The links of ``page`` that do not resolve, each with the reason."""
  with open(page) as f:
    text = f.read()
  # Links inside code (fenced blocks, inline spans) are not links.
  prose = re.sub(r"```.*?```", "", text, flags=re.S)
  prose = re.sub(r"`[^`\n]*`", "", prose)
  bad = []
  for target in _LINK.findall(prose):
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto: ...
      continue
    path, _, anchor = target.partition("#")
    where = (os.path.normpath(os.path.join(os.path.dirname(page), path))
             if path else page)
    if not os.path.exists(where):
      bad.append(f"{target}: no such file")
    elif anchor and where.endswith(".md"):
      with open(where) as f:
        if anchor not in anchors(f.read()):
          bad.append(f"{target}: no heading with that anchor")
  return bad


def test_slugs_follow_githubs_rules():
  assert slug("Shapes and BT beyond the cache: the nearest entry's "
              "tiling") == ("shapes-and-bt-beyond-the-cache-the-nearest-"
                            "entrys-tiling")
  assert slug("Llama-3.1-8B, scanned: the paper's headline") == (
      "llama-31-8b-scanned-the-papers-headline")
  assert slug("`backend=None` and `FORGE_BACKEND`") == (
      "backendnone-and-forge_backend")
  assert anchors("# A\n## A\n```\n# not a heading\n```\n### B c") == {
      "a", "a-1", "b-c"}


def test_a_broken_link_is_reported(tmp_path):
  page = tmp_path / "p.md"
  (tmp_path / "q.md").write_text("# Kept\n")
  page.write_text("# Here\n[ok](q.md#kept) [self](#here) [web](https://x)"
                  " `[code](nowhere.md)`\n[gone](nowhere.md) "
                  "[moved](q.md#lost) [missing](#nope)\n")
  assert broken_links(str(page)) == [
      "nowhere.md: no such file", "q.md#lost: no heading with that anchor",
      "#nope: no heading with that anchor"]


@pytest.mark.parametrize("page", PAGES,
                         ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_every_link_of_the_docs_resolves(page):
  assert broken_links(page) == []
