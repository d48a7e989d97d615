"""The documentation's benchmark commands name flags their modules have:
every ``benchmarks.<module> [subcommand] --flag ...`` in a code span or
block of README.md, CHANGELOG.md, docs/*.md and benchmarks/results/README.md
names a module of ``benchmarks/`` whose ``--help`` lists each flag."""

import contextlib
import glob
import importlib
import io
import os
import re
import sys
from unittest import mock

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, "README.md"),
                os.path.join(ROOT, "CHANGELOG.md"),
                os.path.join(ROOT, "benchmarks", "results", "README.md")]
               + glob.glob(os.path.join(ROOT, "docs", "*.md")))
# A fenced block or a code span (which may wrap a line).
_CODE = re.compile(r"```.*?```|`[^`]+`", re.S)
# A module run as a command, what follows it up to a shell separator.
# (Not a name inside a module: ``benchmarks.common.traced``.)
_COMMAND = re.compile(r"benchmarks\.(\w+)(?![\w.])((?:[ \t\n]+[^\s`|;&]+)*)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def commands(text: str) -> list[tuple[str, str | None, list[str]]]:
  """``(module, subcommand or None, flags)`` of each benchmark command in
  ``text``'s code."""
  found = []
  for code in _CODE.finditer(text):
    for m in _COMMAND.finditer(code.group(0)):
      words = m.group(2).split()
      sub = words[0] if words and re.fullmatch(r"[a-z_]+", words[0]) else None
      found.append((m.group(1), sub, _FLAG.findall(m.group(2))))
  return found


def help_text(module: str, sub: str | None) -> str:
  """What ``python -m benchmarks.<module> [sub] --help`` prints."""
  main = importlib.import_module(f"benchmarks.{module}").main
  argv = [sub, "--help"] if sub else ["--help"]
  out = io.StringIO()
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
    try:
      main(argv)
    except TypeError:  # a main() that reads sys.argv itself
      with mock.patch.object(sys, "argv", [module, *argv]):
        main()
  return out.getvalue()


def test_commands_are_found():
  text = ("run `./dev.sh python -m benchmarks.kernel --torch on --out K.csv`"
          " or\n```\npython -m benchmarks.low_precision error --steps 3\n```"
          " (`benchmarks.common.traced` is no command)")
  assert commands(text) == [("kernel", None, ["--torch", "--out"]),
                            ("low_precision", "error", ["--steps"])]


def test_a_flag_the_module_lacks_is_reported():
  flags = commands("`python -m benchmarks.kernel --no-such-flag`")[0][2]
  assert "--no-such-flag" not in help_text("kernel", None)
  assert flags == ["--no-such-flag"]


def test_the_docs_hold_commands():
  """The pages' commands are found (a pattern that found none would make
  the check below pass on every page)."""
  found = []
  for page in PAGES:
    with open(page) as f:
      found += commands(f.read())
  assert len(found) >= 30 and sum(len(f) for _, _, f in found) >= 50


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_documented_flag_exists(page):
  pytest.importorskip("torch")  # the torch benchmarks' modules import it
  with open(page) as f:
    found = commands(f.read())
  helps, missing = {}, []
  for module, sub, flags in found:
    if not os.path.exists(os.path.join(ROOT, "benchmarks", module + ".py")):
      missing.append(f"benchmarks.{module}: no such module")
      continue
    if (module, sub) not in helps:
      helps[module, sub] = help_text(module, sub)
    for flag in flags:
      if not re.search(re.escape(flag) + r"(?![a-z0-9-])",
                       helps[module, sub]):
        missing.append(f"benchmarks.{module} {sub or ''} {flag}")
  assert not missing, missing
