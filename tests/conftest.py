import glob
import os
import warnings

# Without a GPU the suite's time is mostly XLA compiling small CPU programs:
# LLVM's optimisation passes off compiles them about a third faster, with
# the same semantics (no fast-math). Not on a GPU machine, whose compiled
# steps some tests inspect; flags the user set in XLA_FLAGS win.
if not glob.glob("/dev/nvidia[0-9]*"):
  _flags = os.environ.get("XLA_FLAGS", "")
  for _flag in ("--xla_backend_optimization_level=0",
                "--xla_llvm_disable_expensive_passes=true"):
    if _flag.split("=")[0] not in _flags:
      _flags += " " + _flag
  os.environ["XLA_FLAGS"] = _flags.strip()
# Each test process would otherwise reserve 75 % of the GPU's memory when
# JAX starts: a second pytest-xdist worker on the same GPU would fail to
# allocate anything. A value the user set wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402 -- after XLA_FLAGS
import pytest  # noqa: E402

warnings.filterwarnings(
    "ignore", message="The Pallas Triton backend is deprecated",
    category=DeprecationWarning)


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


HAS_GPU = _has_gpu()


def pytest_addoption(parser):
  parser.addoption(
      "--full", action="store_true", default=False,
      help="run the whole suite; without it the quick tier (tests/tiers.py) "
           "leaves out the cases listed there")


def _names(nodeid: str, entry: str) -> bool:
  """Whether ``entry`` (a file, a test or one case) names ``nodeid``."""
  return nodeid == entry or nodeid.startswith((entry + "[", entry + "::"))


def _quick_tier(config, items):
  """Deselects the cases ``tests/tiers.py`` leaves to ``--full``."""
  from tests import tiers  # noqa: PLC0415 -- only when the tier applies
  files = {item.nodeid.split("::")[0] for item in items}
  for group in tiers.GROUPS:
    for entry in group.full + group.keep:
      if (entry.split("::")[0] in files
          and not any(_names(item.nodeid, entry) for item in items)):
        raise pytest.UsageError(
            f"tests/tiers.py names {entry!r}, which is not a collected test; "
            "update the entry to the test's current name")
  def full_only(item):
    if "gpu" in item.keywords:
      return False
    return any(any(_names(item.nodeid, e) for e in g.full)
               and not any(_names(item.nodeid, e) for e in g.keep)
               for g in tiers.GROUPS)
  left, kept = [], []
  for item in items:
    (left if full_only(item) else kept).append(item)
  if left:
    config.hook.pytest_deselected(items=left)
    items[:] = kept
  config.stash[_LEFT_TO_FULL] = len(left)
  if hasattr(config, "workeroutput"):  # a pytest-xdist worker: tell the
    config.workeroutput["left_to_full"] = len(left)  # controller (below)


_LEFT_TO_FULL = pytest.StashKey[int]()


class _WorkersLeftToFull:
  """With pytest-xdist the workers collect; the controller, which prints
  the summary, takes the count from them (every worker collects alike)."""

  def __init__(self, config):
    self.config = config

  def pytest_testnodedown(self, node, error):  # pylint: disable=unused-argument
    left = getattr(node, "workeroutput", {}).get("left_to_full", 0)
    self.config.stash[_LEFT_TO_FULL] = max(
        left, self.config.stash.get(_LEFT_TO_FULL, 0))


def pytest_configure(config):
  if (config.pluginmanager.hasplugin("xdist")
      and not hasattr(config, "workeroutput")):
    config.pluginmanager.register(_WorkersLeftToFull(config))


def pytest_collection_finish(session):
  """On a GPU machine, the GPU-marked torch tests selected (after -m / -k)
  would each skip (their ``skipif(not torch.cuda.is_available())``) under
  a torch without CUDA: a whole GPU check reported as skipped. Refuse the
  run instead."""
  if not HAS_GPU:
    return
  torch_gpu = [i for i in session.items
               if "gpu" in i.keywords and "torch" in i.nodeid]
  if not torch_gpu:
    return
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    return  # the torch test files skip at import, saying so
  if not torch.cuda.is_available():
    raise pytest.UsageError(
        f"JAX sees a GPU but torch has no CUDA device: the "
        f"{len(torch_gpu)} GPU-marked torch tests would be skipped. Install "
        "a CUDA build of torch, or deselect them (-k 'not torch').")


@pytest.hookimpl(tryfirst=True)  # before -m / -k: tiers.py names all tests
def pytest_collection_modifyitems(config, items):
  # The quick tier applies when whole files or folders run; tests named on
  # the command line (file::test) run whatever their tier.
  if not config.getoption("full") and not any(
      "::" in str(arg) for arg in config.args):
    _quick_tier(config, items)
  if HAS_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, config):
  left = config.stash.get(_LEFT_TO_FULL, 0)
  if left:
    terminalreporter.write_line(
        f"quick tier: {left} case{'s' if left != 1 else ''} (none "
        "GPU-marked) left to the full suite "
        "(tests/tiers.py); ./dev.sh test --full runs them")


@pytest.fixture(autouse=True)
def _fp32_matmuls_are_ieee():
  """fp32 references run with IEEE fp32 dots: XLA's GPU default is TF32.

  (The fused kernel already uses IEEE fp32 for fp32 operands; this puts the
  optax/nn.Dense references and the layers' forward/dx on the same footing.)
  """
  with jax.default_matmul_precision("highest"):
    yield
