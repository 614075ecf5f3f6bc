"""Where metrics go: WORKDIR/metrics.jsonl, TensorBoard event files and a console progress bar."""

import json
import os

import jax
import tensorboardX
import tqdm


class MetricsWriter:
  """Writes from process 0 only; every record carries `step`."""

  def __init__(self, workdir: str, total_steps: int, initial_step: int = 0):
    self.active = jax.process_index() == 0
    if not self.active:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    _drop_torn_last_line(path)
    self.jsonl = open(path, "a")
    self.tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))
    self.bar = tqdm.tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True)

  def advance(self, n: int = 1):
    if self.active:
      self.bar.update(n)

  def write(self, step: int, metrics: dict[str, float]):
    if not self.active:
      return
    record = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
    self.jsonl.write(json.dumps(record) + "\n")
    self.jsonl.flush()
    for k, v in metrics.items():
      self.tb.add_scalar(k, float(v), step)
    shown = {k: f"{v:.4g}" for k, v in metrics.items() if k in ("loss", "val_loss", "tokens_per_s", "mfu")}
    self.bar.set_postfix(shown, refresh=False)
    self.bar.write(f"step {step}: " + " ".join(f"{k}={v}" for k, v in shown.items()))

  def close(self):
    if self.active:
      self.bar.close()
      self.tb.close()
      self.jsonl.close()


def _drop_torn_last_line(path: str) -> None:
  """A process killed mid-write can leave half a record; cut it before appending."""
  if not os.path.exists(path):
    return
  with open(path, "rb+") as f:
    data = f.read()
    if data and not data.endswith(b"\n"):
      f.truncate(data.rfind(b"\n") + 1)
