"""A decoder's weights with each layer's parameters in buffers of their own (unrolled decoding).

A stack's parameters lead with the `layers` axis (`blocks.make_stack`) and `decode_stack`
scans over them. XLA:CPU's dot cannot read a slice of a larger buffer, so that scan copies
every layer's weights out of the stack at every decode step: 42% of the op time of a
SmolLM2-135M batch-8 step on 2 CPU cores (docs/notes/cpu_decode.md).

`unstack` splits the stack once, outside jit, into one state per layer. Inside jit, `merge`
rebuilds the model with `blocks` a list of per-layer Blocks, which `decode_stack` runs as a
Python loop: the same Block code, its dots reading each layer's weights where they lie. The
merged model holds no stacked parameters, so a training forward on it raises (`run_stack`)
instead of silently restacking them. The inference engines decide when to use it
(`infer.Engine(unroll_layers=...)`: its decode steps); training keeps the scan.
"""

from typing import NamedTuple

import jax
from flax import nnx

STACK = "blocks"  # the decoder stack's attribute in models/transformer.py
DENSE_STACK = "dense_blocks"  # its first dense blocks, where a MoE decoder has some (DeepSeek)


class LayerWeights(NamedTuple):
  """A model's state split for unrolled decoding (a pytree: a jit argument like any state)."""
  rest: nnx.State                 # every parameter outside the stacks
  layers: tuple[nnx.State, ...]   # the stack's, one state per layer (no leading axis)
  dense: tuple[nnx.State, ...] = ()  # the dense stack's, likewise


def _split(stack) -> tuple:
  n = jax.tree.leaves(stack)[0].shape[0]
  return tuple(jax.tree.map(lambda a, i=i: a[i], stack) for i in range(n))


def unstack(state: nnx.State) -> LayerWeights:
  """Copies each layer's parameters out of the stacks once (outside jit)."""
  if STACK not in state:
    raise ValueError(f"unstack: the state has no {STACK!r} stack (keys {sorted(state.keys())})")
  rest = nnx.State({k: v for k, v in state.items() if k not in (STACK, DENSE_STACK)})
  dense = _split(state[DENSE_STACK]) if DENSE_STACK in state else ()
  return LayerWeights(rest, _split(state[STACK]), dense)


def merge(graphdef, weights):
  """The model from a state, or from LayerWeights with its stacks lists of per-layer Blocks."""
  if not isinstance(weights, LayerWeights):
    return nnx.merge(graphdef, weights)
  stacks = {STACK: weights.layers, **({DENSE_STACK: weights.dense} if weights.dense else {})}
  shapes = {name: jax.tree.map(lambda a, n=len(layers): jax.ShapeDtypeStruct((n, *a.shape),
                                                                             a.dtype), layers[0])
            for name, layers in stacks.items()}
  model = nnx.merge(graphdef, nnx.State({**dict(weights.rest.items()), **shapes}))
  for name, layers in stacks.items():
    block_def = nnx.graphdef(getattr(model, name))
    setattr(model, name, [nnx.merge(block_def, layer) for layer in layers])
  return model


def is_unrolled(model) -> bool:
  """Whether `model` came from `merge` of LayerWeights (its decode runs unrolled)."""
  return isinstance(getattr(model, STACK, None), list)
