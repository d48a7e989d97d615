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


def pytest_collection_modifyitems(config, items):
  if HAS_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fp32_matmuls_are_ieee():
  """fp32 references run with IEEE fp32 dots: XLA's GPU default is TF32.

  (The fused kernel already uses IEEE fp32 for fp32 operands; this puts the
  optax/nn.Dense references and the layers' forward/dx on the same footing.)
  """
  with jax.default_matmul_precision("highest"):
    yield
