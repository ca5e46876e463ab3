"""The links of the README, the docs and the benchmarks' README lead to
files that exist: every relative Markdown link (and its ``#anchor``, where
it names a heading of a Markdown file), and every results file named in
code (a path under ``results/``, or a bare file name found anywhere
there; ``<version>``, ``...`` and ``{a,b}`` as wildcards).
No jax, no network."""

import itertools
import pathlib
import re

import pytest

# Reads only this checkout's files: the same on every jax.
pytestmark = pytest.mark.once

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\n]+)`")


def _anchors(path: pathlib.Path) -> set[str]:
  """The anchors of ``path``'s headings, as GitHub makes them."""
  found = set()
  for line in path.read_text().splitlines():
    heading = re.match(r"#+\s+(.*)", line)
    if heading:
      text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
      found.add(text.replace(" ", "-"))
  return found


def _globs(pattern: str) -> list[str]:
  """``pattern`` with ``{a,b}`` expanded and ``<...>``, ``...`` as ``*``."""
  pattern = re.sub(r"<[^>]*>", "*", pattern).replace("...", "*")
  parts = re.split(r"\{([^}]*)\}", pattern)
  choices = [[p] if k % 2 == 0 else p.split(",") for k, p in enumerate(parts)]
  return ["".join(c) for c in itertools.product(*choices)]


def _ids(path):
  return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", FILES, ids=_ids)
def test_relative_links_resolve(doc):
  missing = []
  for target in _LINK.findall(doc.read_text()):
    if re.match(r"[a-z]+:", target):
      continue   # a URL
    path, _, anchor = target.partition("#")
    where = (doc.parent / path).resolve() if path else doc
    if not where.exists():
      missing.append(f"{target}: no {where.relative_to(ROOT)}")
    elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
      missing.append(f"{target}: no heading #{anchor} in "
                     f"{where.relative_to(ROOT)}")
  assert not missing, f"{_ids(doc)}: " + "; ".join(missing)


@pytest.mark.parametrize("doc", FILES, ids=_ids)
def test_results_files_named_in_code_exist(doc):
  missing = []
  for span in _CODE.findall(doc.read_text()):
    name = span.split()[0] if span.split() else ""
    if not re.search(r"\.(txt|json|md|png)$", name):
      continue
    start = max(name.find("results/"), name.find("archive/"))
    if start >= 0:   # a path under benchmarks/results
      relative = name[start:]
      if not relative.startswith("results/"):
        relative = "results/" + relative
    elif "/" in name or name.startswith((".", "*")) or "<" in name:
      continue     # another folder's file, or a naming scheme
    else:          # a bare file name: anywhere under the results
      relative = "results/**/" + name
    if not any(list((ROOT / "benchmarks").glob(g)) for g in _globs(relative)):
      missing.append(name)
  assert not missing, f"{_ids(doc)} names results that do not exist: {missing}"
