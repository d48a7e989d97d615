"""The packages' layout: no import cycles, and the kernels stand alone.

Every import statement of every module of ``pallas_kernels``, ``forge_jax``
and ``forge_torch`` counts, function-level ones included (a function-level
import is how a cycle hides). ``pallas_kernels`` imports no flax, optax or
torch: the framework layers sit on the kernels, not the other way round.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pallas_kernels", "forge_jax", "forge_torch")
FRAMEWORKS = ("flax", "optax", "torch")


def _modules() -> dict[str, str]:
  """Module name -> file path, for every module of :data:`PACKAGES`."""
  found = {}
  for package in PACKAGES:
    for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
      dirs[:] = sorted(d for d in dirs if d != "__pycache__")
      rel = os.path.relpath(folder, ROOT).split(os.sep)
      for name in sorted(files):
        if not name.endswith(".py"):
          continue
        parts = rel if name == "__init__.py" else rel + [name[:-3]]
        found[".".join(parts)] = os.path.join(folder, name)
  return found


def _imported(path: str, module: str, is_package: bool):
  """``(line, imported module name)`` for each import in the file, with
  relative imports resolved and ``from X import Y`` naming ``X.Y`` (which
  the caller keeps if it is a module) as well as ``X``."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  package = module if is_package else module.rpartition(".")[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name, None
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
      for alias in node.names:
        yield node.lineno, base, alias.name


def _graph() -> dict[str, dict[str, int]]:
  """Module -> {module of the three packages it imports: line}."""
  modules = _modules()
  graph = {}
  for module, path in modules.items():
    edges = graph.setdefault(module, {})
    is_package = path.endswith("__init__.py")
    for line, base, name in _imported(path, module, is_package):
      if name is not None and f"{base}.{name}" in modules:
        target = f"{base}.{name}"  # from package import submodule
      elif base in modules:
        target = base
      else:
        continue  # another package (jax, numpy, ...)
      if target != module:
        edges.setdefault(target, line)
  return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
  """One cycle through each strongly connected component of ``graph`` that
  has more than one module (Tarjan's algorithm, then a path back)."""
  index, low, on_stack, stack, sccs = {}, {}, set(), [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      scc = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        scc.append(w)
        if w == v:
          break
      if len(scc) > 1:
        sccs.append(sorted(scc))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  cycles = []
  for scc in sccs:
    members, start = set(scc), scc[0]
    # The shortest path start -> ... -> start inside the component.
    paths, seen = [[start]], {start}
    while paths:
      path = paths.pop(0)
      nxt = [w for w in sorted(graph[path[-1]]) if w in members]
      if start in nxt:
        cycles.append(path + [start])
        break
      for w in nxt:
        if w not in seen:
          seen.add(w)
          paths.append(path + [w])
  return cycles


def _describe(graph, cycle) -> str:
  return " -> ".join(
      f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])
  ) + f" -> {cycle[-1]}"


def test_the_modules_are_found():
  modules = _modules()
  for name in ("pallas_kernels", "pallas_kernels.fused_wgrad",
               "pallas_kernels.families", "forge_jax.dense",
               "forge_torch.optim"):
    assert name in modules, name


def test_no_import_cycles():
  graph = _graph()
  cycles = _cycles(graph)
  assert not cycles, "import cycles:\n" + "\n".join(
      _describe(graph, c) for c in cycles)


def test_cycle_finder_reports_a_function_level_cycle():
  graph = {"a": {"b": 3}, "b": {"c": 10}, "c": {"a": 7}, "d": {"a": 1}}
  (cycle,) = _cycles(graph)
  assert cycle == ["a", "b", "c", "a"]
  assert _describe(graph, cycle) == (
      "a (line 3) -> b (line 10) -> c (line 7) -> a")


@pytest.mark.parametrize("module", sorted(
    m for m in _modules() if m.split(".")[0] == "pallas_kernels"))
def test_pallas_kernels_imports_no_framework(module):
  path = _modules()[module]
  bad = [(line, f"{base}.{name}" if name else base)
         for line, base, name in _imported(path, module,
                                           path.endswith("__init__.py"))
         if base.split(".")[0] in FRAMEWORKS]
  assert not bad, f"{module} imports {bad}"


def test_importing_pallas_kernels_loads_no_framework():
  code = ("import sys, pallas_kernels, pallas_kernels.autotune; "
          f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                       capture_output=True, text=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_forge_torch_without_torch_says_how_to_install_it():
  """torch is an optional dependency: without it, importing forge_torch
  names the extra that installs it (a bare ModuleNotFoundError from a
  module deep inside would not)."""
  code = ("import sys; sys.modules['torch'] = None\n"  # (as if not installed)
          "try:\n  import forge_torch\n"
          "except ImportError as e:\n  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                       capture_output=True, text=True)
  assert out.stdout.startswith(
      "forge_torch needs PyTorch, an optional dependency of forge-jax: "
      "install it with the torch extra"), out.stdout + out.stderr
