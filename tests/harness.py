"""What the test suites share: the reference training step FORGE is compared
against, the odd-width MLP, its loss, a weight-decay mask, and deviceless
lowering for CUDA (catches Triton lowering errors on a CPU-only machine)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks.common import optax_step

# MLP widths: in -> hidden -> hidden -> out; no kernel dimension is a power of
# two, so every kernel tile is partial somewhere.
WIDTHS = (37, 70, 130, 5)


class MLP(nn.Module):
  """``WIDTHS`` with ReLUs; ``dense`` is ``nn.Dense`` or ``forge_jax.Dense``."""
  dense: type
  dead_head: bool = False  # an extra layer whose output is unused (Remark 1)

  @nn.compact
  def __call__(self, x):
    x = nn.relu(self.dense(WIDTHS[1])(x))
    x = nn.relu(self.dense(WIDTHS[2])(x))
    y = self.dense(WIDTHS[3])(x)
    if self.dead_head:  # computed, never reaches the loss
      self.dense(WIDTHS[3], name="aux")(x)
    return y


def mlp_data(steps: int, bt: int):
  """``steps`` batches of ``bt`` random tokens for the odd-width MLP
  (inputs ``xs``, targets ``ys``) and its ``nn.Dense`` initialisation."""
  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  xs = jax.random.normal(kx, (steps, bt, WIDTHS[0]))
  ys = jax.random.normal(ky, (steps, bt, WIDTHS[-1]))
  variables = MLP(nn.Dense).init(kp, xs[0])
  return xs, ys, variables


def mse(model):
  """``loss_fn(variables, (x, y))``: mean squared error of ``model``, in fp32
  (a bf16 model's output is upcast first)."""
  def loss_fn(variables, batch):
    x, y = batch
    out = model.apply(variables, x).astype(jnp.float32)
    return jnp.mean((out - y) ** 2)
  return loss_fn


def step_once(model, tx, batch, seed=0):
  """Initialises ``model`` on ``batch`` and runs one ``forge_jax.make_step``
  step with ``tx`` (for checks that the step refuses a model)."""
  import forge_jax  # noqa: PLC0415 -- the kernel suites need no flax layer
  variables = model.init(jax.random.key(seed), batch[0])
  return forge_jax.make_step(mse(model), tx)(
      variables, tx.init(variables["params"]), batch)


def decay_kernels_only(params):
  """A weight-decay mask: matrices yes, biases no."""
  return jax.tree.map(lambda a: a.ndim > 1, params)


# ``step(variables, opt_state, batch) -> (loss, variables, opt_state)``: plain
# ``jax.value_and_grad`` + the optax transform (not jitted) -- the same
# standard-path arm the benchmarks measure FORGE against.
reference_step = optax_step


def run_reference(ref_step, variables, optax_tx, batches):
  """The reference step over ``batches`` from ``variables`` and a fresh
  ``optax_tx`` state. Returns ``((v_ref, s_ref), [reference loss, ...])``,
  which :func:`train_side_by_side` takes as its ``reference``."""
  v_ref, s_ref = variables, optax_tx.init(variables["params"])
  losses = []
  for batch in batches:
    l_ref, v_ref, s_ref = ref_step(v_ref, s_ref, batch)
    losses.append(float(l_ref))
  return (v_ref, s_ref), losses


def shared_reference(runs, key, ref_step, variables, optax_tx, batches):
  """The reference's run under ``key`` in ``runs`` (a dict that tests
  sharing one reference keep), made by :func:`run_reference` on first
  use."""
  if key not in runs:
    runs[key] = run_reference(ref_step, variables, optax_tx, batches)
  return runs[key]


def train_side_by_side(forge_step, ref_step, variables, forge_tx, optax_tx,
                       batches, reference=None):
  """Runs the FORGE step (jitted, donating: it gets a copy of ``variables``)
  and the reference step over the same batches from the same start. Returns
  ``((v_f, s_f), (v_ref, s_ref), [(forge loss, reference loss), ...])``.
  ``reference``: the reference's run as :func:`run_reference` returned it
  for these ``ref_step``, ``variables``, ``optax_tx`` and ``batches`` (tests
  that share one reference run it once)."""
  v_f = jax.tree.map(jnp.copy, variables)
  s_f = forge_tx.init(v_f["params"])
  if reference is None:
    reference = run_reference(ref_step, variables, optax_tx, batches)
  (v_ref, s_ref), ref_losses = reference
  assert len(ref_losses) == len(batches)
  losses = []
  for batch, l_ref in zip(batches, ref_losses):
    l_f, v_f, s_f = forge_step(v_f, s_f, batch)
    losses.append((float(l_f), l_ref))
  return (v_f, s_f), (v_ref, s_ref), losses


def lower_for_cuda(fn, *args, donate_argnums=()) -> str:
  """StableHLO text of ``jax.jit(fn)`` lowered for an H200 without a GPU
  (deviceless AOT). ``args``: trees of arrays or ``ShapeDtypeStruct``s."""
  from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
      "NVIDIA H200", 132, "gpu"))
  sh = NamedSharding(mesh, P())
  abstract = lambda t: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), t)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn, donate_argnums=donate_argnums).trace(
        *map(abstract, args)).lower(lowering_platforms=("cuda",)).as_text()


def lower_rule_for_cuda(rule: pk.UpdateRule) -> str:
  """The fused kernel with ``rule`` on fp32 (70, 130) state, lowered for CUDA."""
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)

  def step(x, dy, w, h, *slots):
    return pk.fused_wgrad_update(x, dy, w, slots, h, rule=rule,
                                 interpret=False)

  return lower_for_cuda(step, f32(37, 70), f32(37, 130), f32(70, 130),
                        f32(pk.HPARAM_VECTOR_LEN),
                        *[f32(70, 130)] * len(rule.slots))


def triton_calls(text: str) -> list[str]:
  """The lines of lowered text that call a Triton kernel."""
  return [l for l in text.splitlines() if "xla.gpu.triton" in l]


def assert_pool_saved_in_place(forge_compiled, ref_compiled, run, pool,
                               stack_bytes):
  """A scanned FORGE step against flax's scan + optax: its compiled
  temporaries are at least 0.9 x the gradient ``pool`` (bytes) below the
  reference's, no array of ``stack_bytes`` or more is copied inside a
  while-loop body of the compiled step, and running it (``run = (jitted,
  variables, opt_state, x)``) returns the donated params, mu and nu in their
  own buffers."""
  from benchmarks import hlo_schedule
  assert hlo_schedule.loop_copies(forge_compiled.as_text(), stack_bytes) == []
  jitted, variables, opt_state, x = run
  temp = forge_compiled.memory_analysis().temp_size_in_bytes
  ref_temp = ref_compiled.memory_analysis().temp_size_in_bytes
  assert temp <= ref_temp - 0.9 * pool, (temp, ref_temp, pool)
  leaves = lambda v, s: jax.tree.leaves((v["params"], s[0].mu, s[0].nu))
  ptrs = [a.unsafe_buffer_pointer() for a in leaves(variables, opt_state)]
  _, new_v, new_s = jitted(variables, opt_state, x)
  assert [a.unsafe_buffer_pointer() for a in leaves(new_v, new_s)] == ptrs


def assert_mirrors_flax_fields(ours, flax_cls):
  """``ours`` (a FORGE layer class) has ``flax_cls``'s dataclass fields
  first, in order, with the same defaults."""
  ref = [f for f in flax_cls.__dataclass_fields__ if f not in ("parent", "name")]
  got = [f for f in ours.__dataclass_fields__ if f not in ("parent", "name")]
  assert got[:len(ref)] == ref
  for f in ref:
    assert (ours.__dataclass_fields__[f].default ==
            flax_cls.__dataclass_fields__[f].default), f


# --- Reading a step's jaxpr ----------------------------------------------------


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for item in (v if isinstance(v, (tuple, list)) else (v,)):
      if hasattr(item, "eqns"):
        yield item
      elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
        yield item.jaxpr


def jaxpr_eqns(jaxpr):
  """Every equation, through calls, custom rules and control flow (not into
  a Pallas kernel's body: its dots are tile-sized)."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name != "pallas_call":
      for sub in _sub_jaxprs(eqn):
        yield from jaxpr_eqns(sub)


def kernel_gradient_dots(jaxpr, kernel_shapes, bt):
  """``dot_general``s outside Pallas kernels that contract the ``bt`` token
  axis into a kernel-shaped output (either orientation): the weight
  gradients ``G = x^T dy``, as the kernel shapes they match."""
  found = []
  for eqn in jaxpr_eqns(jaxpr):
    if eqn.primitive.name != "dot_general":
      continue
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = tuple(eqn.outvars[0].aval.shape)
    if [lhs[d] for d in lc] == [bt]:
      if out in kernel_shapes:
        found.append(out)
      elif out[::-1] in kernel_shapes:  # AD forms dy^T x, then transposes
        found.append(out[::-1])
  return found


def spy_launches(monkeypatch, module):
  """Records the tiling (``cfg``) of each ``module.launch`` call (a kernel
  module of pallas_kernels), still launching; returns the list."""
  seen = []
  real = module.launch

  def launch(*args, **kwargs):
    seen.append(kwargs["cfg"])
    return real(*args, **kwargs)

  monkeypatch.setattr(module, "launch", launch)
  return seen
