"""A simple sampling loop: recompute the whole (fixed-size) buffer every step.

No KV cache yet; the buffer length is rounded up so one compilation serves
many prompt lengths. Causal masking makes the padding after the cursor inert.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

_BUCKET = 64


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k"))
def _next_token(graphdef, state, buffer_1T, cursor, key, temperature, top_k):
  model = nnx.merge(graphdef, state)
  logits_1TV = model(buffer_1T)
  logits_V = jax.lax.dynamic_index_in_dim(logits_1TV[0], cursor - 1, keepdims=False)
  if temperature == 0.0:
    return jnp.argmax(logits_V).astype(jnp.int32)
  logits_V = logits_V / temperature
  if top_k > 0:
    kth = jax.lax.top_k(logits_V, top_k)[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  return jax.random.categorical(key, logits_V).astype(jnp.int32)


def generate(model, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, eos_id: int | None = None) -> list[int]:
  """Returns the new token ids (greedy when temperature == 0), stopping at `eos_id`."""
  if not prompt_ids:
    raise ValueError("generate needs a non-empty prompt")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  total = len(prompt_ids) + max_new_tokens
  limit = model.cfg.max_seq_len
  if total > limit:
    raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                     f"the model's max_seq_len={limit}")
  length = min(-(-total // _BUCKET) * _BUCKET, max(limit, total))
  buffer = jnp.zeros((1, length), jnp.int32).at[0, :len(prompt_ids)].set(jnp.asarray(prompt_ids))
  graphdef, state = nnx.split(model)
  key = jax.random.key(seed)
  new_ids = []
  cursor = len(prompt_ids)
  for _ in range(max_new_tokens):
    key, sub = jax.random.split(key)
    token = int(_next_token(graphdef, state, buffer, cursor, sub, float(temperature), int(top_k)))
    new_ids.append(token)
    if eos_id is not None and token == eos_id:
      break
    buffer = buffer.at[0, cursor].set(token)
    cursor += 1
  return new_ids
