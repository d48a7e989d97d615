"""Slicing an optax state down to one FORGE kernel, and putting it back.

An optax state is a tree of NamedTuples (``ScaleByAdamState``, ``MaskedState``,
``PartitionState``'s dict of states, ...). Some of its fields are
*per-parameter* trees: their structure has the params tree's as a prefix
(``mu``, ``nu``; Adafactor's ``v_row``/``v_col``, whose leaves have other
shapes than the parameters; SM3's ``mu``, a list of arrays per parameter;
``MaskedNode`` where a partition or mask leaves a parameter out). Everything
else is *shared* by all parameters (step counts, Muon's Newton-Schulz
coefficients).

A FORGE kernel at key path ``kp`` owns the subtree at ``kp`` of every
per-parameter field; :func:`walk` visits those fields in a fixed order, so the
same index names the same field in the state before and after an update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional

import jax

KeyPath = tuple[Any, ...]


class Hole(NamedTuple):
  """Marks where a per-parameter field was taken out of a state (no leaves)."""


def is_per_param(value, params_def) -> bool:
  """Whether ``value``'s structure has the params tree's as a prefix."""
  if value is None or isinstance(value, Hole):
    return False
  try:
    params_def.flatten_up_to(value)
  except (ValueError, TypeError):
    return False
  return True


def walk(state, is_field: Callable[[Any, Any, Optional[str]], bool],
         fn: Callable[[int, Any, Optional[str], Any], Any]):
  """Rebuilds ``state`` with ``fn(i, owner, name, tree)`` applied to each field.

  A field is a node for which ``is_field(node, owner, name)`` holds (checked
  top-down, so a field is never entered); ``i`` counts fields in traversal
  order, ``owner`` is the NamedTuple state holding it (``None`` elsewhere)
  and ``name`` its field name there.
  """
  counter = [0]

  def rec(node, owner, name):
    if is_field(node, owner, name):
      i = counter[0]
      counter[0] += 1
      return fn(i, owner, name, node)
    if hasattr(node, "_fields"):  # a NamedTuple state
      return type(node)(*(rec(v, node, f) for f, v in zip(node._fields, node)))
    if isinstance(node, (tuple, list)):
      return type(node)(rec(v, None, None) for v in node)
    if isinstance(node, Mapping):  # e.g. PartitionState.inner_states
      # Visit in sorted key order, as jax flattens dicts: an update may
      # rebuild a dict in another insertion order, and indices must not move.
      try:
        order = sorted(node)
      except TypeError:
        order = list(node)
      done = {k: rec(node[k], None, None) for k in order}
      return type(node)({k: done[k] for k in node})
    return node

  return rec(state, None, None)


@dataclasses.dataclass(frozen=True)
class Field:
  """One per-parameter field of a state: its index, owner and name."""
  index: int
  owner: Any
  name: Optional[str]
  tree: Any

  def matches(self, spec_field) -> bool:
    """Whether a ``ForgeSpec.slot_fields`` entry (a name, or a
    ``(StateClass, name)`` pair) names this field."""
    return field_matches(spec_field, self.owner, self.name)


def field_matches(spec_field, owner, name) -> bool:
  """Whether ``spec_field`` (a name, or a ``(StateClass, name)`` pair) names
  the field ``name`` of the NamedTuple state ``owner``."""
  if owner is None:
    return False
  if isinstance(spec_field, tuple):
    cls, field = spec_field
    return isinstance(owner, cls) and name == field
  return name == spec_field


def per_param_fields(state, params_def) -> list[Field]:
  found: list[Field] = []

  def record(i, owner, name, tree):
    found.append(Field(i, owner, name, tree))
    return tree

  walk(state, lambda v, owner, name: is_per_param(v, params_def), record)
  return found


def map_per_param(state, params_def, fn: Callable[[int, Any], Any]):
  """``state`` with ``fn(i, tree)`` applied to its ``i``-th per-param field."""
  return walk(state, lambda v, owner, name: is_per_param(v, params_def),
              lambda i, owner, name, tree: fn(i, tree))


def get_subtree(tree, kp: KeyPath):
  for k in kp:
    tree = tree[k.key]
  return tree


def replace_subtrees(tree, new: dict[KeyPath, Any]):
  """``tree`` (nested mappings) with the subtrees at the key paths replaced."""
  if not new:
    return tree

  def rec(node, prefix):
    if prefix in new:
      return new[prefix]
    if not isinstance(node, Mapping):
      return node
    if not any(kp[:len(prefix)] == prefix and len(kp) > len(prefix)
               for kp in new):
      return node
    return type(node)({k: rec(v, prefix + (jax.tree_util.DictKey(k),))
                       for k, v in node.items()})

  return rec(tree, ())


@dataclasses.dataclass(frozen=True, eq=False)
class KernelLayout:
  """Where one FORGE kernel's optimizer state lives (static, per kernel).

  Attributes:
    keypath: the kernel's key path in the params tree.
    slot_ids: the per-parameter fields (:func:`walk` indices) that travel as
      the layer's slots, in slot order.
    slot_defs: for each of them, the structure of the kernel's subtree (one
      array for an epilogue slot; e.g. a list of arrays for SM3).
    shared_def: deferred path only: the structure of the state with its
      per-parameter fields replaced by :class:`Hole`; its leaves are the
      layer's ``shared`` inputs.
    params_skeleton: deferred path only: the params tree with ``None``
      leaves, into which the kernel's arrays are put to make one-leaf trees.
    leaf_dtypes: low-precision state only: the dtypes of the slot leaves as
      the state stores them (int8 codes travel through the layer as a float
      dtype of the same width: ``forge_jax.low_precision.to_transport``).
  """

  keypath: KeyPath
  slot_ids: tuple[int, ...]
  slot_defs: tuple[Any, ...]
  shared_def: Any = None
  params_skeleton: Any = None
  leaf_dtypes: Optional[tuple[Any, ...]] = None

  def split(self, leaves):
    """The flat slot arrays, regrouped into one subtree per slot field."""
    out, start = [], 0
    for d in self.slot_defs:
      out.append(jax.tree.unflatten(d, leaves[start:start + d.num_leaves]))
      start += d.num_leaves
    return out

  def one_leaf(self, subtree):
    """A params-structured tree holding only ``subtree`` at this kernel."""
    return replace_subtrees(self.params_skeleton, {self.keypath: subtree})


def _children(node) -> dict:
  """``node``'s children by key entry (``DictKey``, ``SequenceKey``, ...):
  empty for a leaf or a node without children."""
  found = jax.tree_util.tree_flatten_with_path(
      node, is_leaf=lambda x: x is not node)[0]
  return {kp[0]: child for kp, child in found if kp}


def tree_mismatch(tree, params_def) -> str:
  """Where ``tree`` (a state field) departs from the params tree's
  structure, in plain words: the first parameter it has no entry for, the
  first entry it has that the parameters lack, or the first node of another
  type, by key path (``jax.tree_util.keystr``)."""
  params = jax.tree.unflatten(params_def, [0] * params_def.num_leaves)
  missing, extra, other = [], [], []

  def rec(t, p, prefix):
    kids = _children(p)
    if not kids:  # a parameter: the field may hold anything for it
      return
    if type(t) is not type(p) and not other:
      other.append((prefix, type(t).__name__, type(p).__name__))
    t_kids = _children(t)
    for k, child in kids.items():
      if k in t_kids:
        rec(t_kids[k], child, prefix + (k,))
      elif not missing:
        missing.append(prefix + (k,))
    extra.extend(prefix + (k,) for k in t_kids if k not in kids)

  rec(tree, params, ())
  where = jax.tree_util.keystr
  said = []
  if missing:
    said.append(f"it has no entry for the parameters at {where(missing[0])}")
  if extra:
    said.append(f"it has an entry at {where(extra[0])}, which the "
                "parameters lack")
  if not said and other:
    at, has, want = other[0]
    said.append(f"at {where(at) or 'its root'} it holds a {has} where the "
                f"parameters hold a {want}")
  return "; ".join(said) or "its tree is not the parameters' tree"


def _no_fields_message(missing, state, params_def) -> str:
  """Why ``state`` has no per-parameter field for the ``missing`` entries of
  a spec's ``slot_fields``: fields of those names whose tree is not the
  parameters' (named, with where they depart and the likely cause), or no
  such field at all."""
  found = []

  def record(i, owner, name, tree):
    found.append((name, tree))
    return tree

  walk(state, lambda v, owner, name: any(
      field_matches(m, owner, name) for m in missing), record)
  if not found:
    return (f"opt_state has no {missing} field(s): was it made by this "
            "transform's init()?")
  name, tree = found[0]
  message = (f"the tree of opt_state's {name!r} field does not match the "
             f"parameters' tree: {tree_mismatch(tree, params_def)}. ")
  params = jax.tree.unflatten(params_def, [0] * params_def.num_leaves)
  if (isinstance(tree, Mapping) and "params" in tree
      and not (isinstance(params, Mapping) and "params" in params)):
    return message + (
        "Its tree has a top-level 'params' key, as if the state was built "
        "over the whole variables dict: build it with "
        "tx.init(variables[\"params\"]), not tx.init(variables).")
  return message + (
      "Was it made by this transform's init() on these parameters "
      "(tx.init(variables[\"params\"]), made again when the model's "
      "parameters change)?")


def select_slots(fields: list[Field], spec, state,
                 params_def) -> tuple[int, ...]:
  """The per-parameter fields that travel as a FORGE layer's slots.

  Regimes 1-2: the fields the spec names, in ``rule.slots`` order; regime 3:
  all of them, in traversal order. ``state`` and ``params_def`` (the
  optimizer state the ``fields`` came from and the params' structure) let
  the error for a missing field say where a field of that name departs from
  the parameters' tree.
  """
  if spec.slot_fields is None:
    return tuple(f.index for f in fields)
  chosen = []
  for name in spec.slot_fields:
    hits = [f for f in fields if f.matches(name)]
    if len(hits) > 1:
      raise ValueError(f"optimizer state has more than one {name!r} field")
    chosen.append(hits[0].index if hits else None)
  missing = [n for n, i in zip(spec.slot_fields, chosen) if i is None]
  if missing:
    raise ValueError(_no_fields_message(missing, state, params_def))
  return tuple(chosen)
