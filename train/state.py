"""The train state: a plain pytree created already sharded from an abstract model.

state = {"params": nnx.State, "opt_state": optax state, "step": int32[], "rng": uint32[2]}
The model's graphdef stays outside the state; `nnx.merge(graphdef, params)`
rebuilds the module inside jitted code.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import models
import parallel
from models import ModelConfig, create_model


def split_abstract_model(model_cfg: ModelConfig):
  """(graphdef, abstract params) without allocating anything."""
  return nnx.split(models.abstract_model(model_cfg), nnx.Param)


def assemble_state(params, tx, seed):
  """The train state of `params` at step 0: `tx`'s fresh optimizer state, the rng of `seed`."""
  return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
          "rng": jax.random.key_data(jax.random.key(seed))}


def state_shardings(abstract_state, mesh, layout: parallel.Layout):
  """Parameters follow `layout.rules`; optimizer state follows `layout.opt_rules` (ZeRO-1)."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return {"params": parallel.logical_shardings(abstract_state["params"], mesh, layout.rules),
          "opt_state": parallel.logical_shardings(abstract_state["opt_state"], mesh,
                                                  layout.opt_rules),
          "step": replicated, "rng": replicated}


def create_train_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh,
                       seed: int, layout: parallel.Layout | None = None, params=None):
  """Returns (graphdef, state, shardings). Parameters are born on their devices.

  With `params` given (e.g. from a pretrained checkpoint), they are placed with
  the rule-derived shardings instead of being initialised.
  """
  graphdef, abstract_params = split_abstract_model(model_cfg)
  abstract = jax.eval_shape(lambda p: assemble_state(p, tx, seed), abstract_params)
  layout = parallel.get_layout("data_parallel") if layout is None else layout
  shardings = state_shardings(abstract, mesh, layout)

  if params is None:
    def init():
      model = create_model(model_cfg, nnx.Rngs(seed))
      return assemble_state(nnx.state(model, nnx.Param), tx, seed)
    with jax.set_mesh(mesh):
      state = jax.jit(init, out_shardings=shardings)()
  else:
    params = jax.device_put(params, shardings["params"])
    state = jax.jit(lambda p: assemble_state(p, tx, seed), out_shardings=shardings)(params)
  return graphdef, state, shardings
