"""Worker: under FSDP over 8 devices each device holds <= 1/8 of params and optimizer state
(plus small replicated tensors). Exits non-zero with a message if not."""

import jax
from ml_collections import ConfigDict

import parallel
from models import ModelConfig
from train.optimizer import make_optimizer
from train.state import create_train_state

assert jax.device_count() == 8, jax.devices()
cfg = ModelConfig(vocab_size=512, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=256)
opt = ConfigDict(dict(lr=1e-3, warmup_steps=1, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
                      weight_decay=0.1, clip_norm=1.0))
tx, _ = make_optimizer(opt, 10)
mesh = parallel.make_mesh({"fsdp": 8})
_, state, _ = create_train_state(cfg, tx, mesh, seed=0, layout=parallel.get_layout("fsdp"))

device = jax.devices()[0]
total, on_device, replicated = 0, 0, 0
for leaf in jax.tree.leaves({"params": state["params"], "opt_state": state["opt_state"]}):
  total += leaf.nbytes
  here = sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
  on_device += here
  if leaf.sharding.is_fully_replicated:
    replicated += leaf.nbytes
small = replicated < 0.01 * total  # only scalars (Adam's count) may stay replicated
limit = total / 8 + replicated
print(f"total={total} on_device={on_device} replicated={replicated} limit={limit}")
assert small, f"replicated bytes {replicated} are not small against {total}"
assert on_device <= limit, f"device 0 holds {on_device} bytes > {limit}"
