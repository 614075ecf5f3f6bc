"""Weak-to-strong generalization (Burns et al. 2023) on frozen features + Bradley-Terry heads.

Task: hh-rlhf pairs as binary classification. Pair i is shown as (A, B) in a seeded random
order; label_N[i] = 1 iff A is the chosen response. A head scores each side,
s(x) = MLP(x) (or linear), and p(A preferred) = sigmoid(s(x_A) - s(x_B)): a Bradley-Terry
model, antisymmetric in the order by construction.

  weak      a head on the weak model's features, trained on ground truth of half A
  student   a head on the strong model's features, trained on the weak head's soft labels
            of half B: "naive" (cross-entropy to the soft labels) or "aux" (the auxiliary
            confidence loss, `aux_conf_targets`)
  ceiling   the student's head trained on ground truth of half B
  PGR       (student - weak) / (ceiling - weak), accuracies on the held-out test split

Splits are by a hash of the conversation's first human turn (align/datasets.record_key),
so one conversation never lands in two splits.
"""

import functools
import gzip
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from align.data import BadRecord, parse_hh
from align.datasets import record_key
from train.data import is_validation

SPLIT_NAMES = ("a", "b", "test")
LOSSES = ("ground_truth", "naive", "aux")


# --- Data ---


def final_exchange(transcript: str) -> tuple[str, str]:
  """(last human turn, the assistant reply to it) of an hh-rlhf transcript."""
  messages = parse_hh(transcript)
  if len(messages) < 2 or messages[-1]["role"] != "assistant" or messages[-2]["role"] != "user":
    raise BadRecord("unparseable", "transcript does not end with a human turn and a reply")
  if not messages[-1]["content"]:
    raise BadRecord("empty_response", "the final reply is empty")
  return messages[-2]["content"], messages[-1]["content"]


class _Skip(Exception):
  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


def load_pairs(path: str, limit: int | None = None) -> tuple[list[dict], dict]:
  """(pairs, skipped): pairs {key, prompt, chosen, rejected} (the final exchanges of both
  transcripts, whose human turns must agree) and the count of skipped records by reason."""
  pairs, skipped = [], {}
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
          raise _Skip("missing_fields")
        prompt, chosen = final_exchange(record["chosen"])
        prompt_r, rejected = final_exchange(record["rejected"])
        if prompt != prompt_r:
          raise _Skip("prompt_mismatch")  # not one decision between two replies
        if chosen == rejected:
          raise _Skip("identical")  # no preference to learn
      except json.JSONDecodeError:
        skipped["bad_json"] = skipped.get("bad_json", 0) + 1
        continue
      except (BadRecord, _Skip) as e:
        skipped[e.reason] = skipped.get(e.reason, 0) + 1
        continue
      pairs.append(dict(key=record_key(record), prompt=prompt, chosen=chosen, rejected=rejected))
      if limit and len(pairs) >= limit:
        break
  if not pairs:
    raise ValueError(f"{path}: no usable preference pairs (skipped: {skipped})")
  return pairs, skipped


def split_indices(keys, test_fraction: float) -> dict:
  """{"a", "b", "test"}: index arrays. test by hash of the key; the rest into halves by a
  second hash of it, so a conversation opening stays in one split."""
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction={test_fraction!r} must be in (0, 1)")
  out = {name: [] for name in SPLIT_NAMES}
  for i, key in enumerate(keys):
    name = "test" if is_validation(key, test_fraction) else (
        "a" if is_validation("weak-to-strong half:" + key, 0.5) else "b")
    out[name].append(i)
  for name, idx in out.items():
    if len(idx) < 2:
      raise ValueError(f"split {name!r} has {len(idx)} pairs; need more data")
  return {name: np.asarray(idx) for name, idx in out.items()}


def present(chosen_ND, rejected_ND, seed: int):
  """(a_ND, b_ND, label_N): each pair in a seeded random order; label 1 iff A is chosen."""
  label_N = np.random.default_rng(seed).integers(0, 2, len(chosen_ND)).astype(np.float32)
  a_ND = np.where(label_N[:, None] > 0, chosen_ND, rejected_ND)
  b_ND = np.where(label_N[:, None] > 0, rejected_ND, chosen_ND)
  return a_ND, b_ND, label_N


# --- Losses ---


def soft_xent(logits_N, targets_N):
  """Mean binary cross-entropy of sigmoid(logits_N) against soft targets in [0, 1]."""
  return jnp.mean(optax.sigmoid_binary_cross_entropy(logits_N, targets_N))


def alpha_at(step, total_steps: int, alpha: float, warmup_frac: float):
  """The aux weight at `step`: ramps linearly from 0 to alpha over warmup_frac of training."""
  if warmup_frac <= 0:
    return jnp.asarray(alpha, jnp.float32)
  return alpha * jnp.minimum(1.0, step / (warmup_frac * total_steps))


def aux_conf_targets(logits_N, weak_N, alpha):
  """(1 - alpha) * weak_N + alpha * hardened student prediction, no gradient through it.

  Hardening (the paper's code, on the class-0 probability p0 = 1 - sigmoid(logits)):
  threshold = quantile(p0, prior), prior = mean(weak_N) the weak labels' positive rate in the
  batch; hard = 1 where p0 < threshold, so the hardened positives' rate matches the prior.
  """
  p0_N = 1.0 - jax.nn.sigmoid(jax.lax.stop_gradient(logits_N))
  threshold = jnp.quantile(p0_N, jnp.mean(weak_N))
  hard_N = (p0_N < threshold).astype(jnp.float32)
  return (1.0 - alpha) * weak_N + alpha * hard_N


def aux_conf_loss(logits_N, weak_N, alpha):
  return soft_xent(logits_N, aux_conf_targets(logits_N, weak_N, alpha))


def pgr(weak: float, student: float, ceiling: float) -> float:
  """Performance gap recovered; nan when the ceiling does not beat the weak model."""
  gap = ceiling - weak
  return float((student - weak) / gap) if gap > 0 else float("nan")


# --- Heads ---


def init_head(key, dim: int, hidden: int):
  """Params of s(x): linear (hidden = 0) or one ReLU hidden layer."""
  k1, k2 = jax.random.split(key)
  if hidden == 0:
    return {"w": jax.random.normal(k1, (dim,)) * 0.01}
  return {"w1": jax.random.normal(k1, (dim, hidden)) * math.sqrt(2.0 / dim),
          "b1": jnp.zeros((hidden,)), "w2": jax.random.normal(k2, (hidden,)) * 0.01}


def score(params, x_ND):
  if "w" in params:
    return x_ND @ params["w"]
  return jax.nn.relu(x_ND @ params["w1"] + params["b1"]) @ params["w2"]


def pair_logits(params, a_ND, b_ND):
  """logit of p(A preferred) = s(A) - s(B)."""
  return score(params, a_ND) - score(params, b_ND)


def standardizer(a_ND, b_ND):
  """(mean_D, scale_D) of the training features (both sides): applied to every split. A
  feature constant in training (a bag-of-words bucket no training reply hits) keeps scale 1:
  dividing by ~0 would blow up any test reply that does hit it."""
  x_ND = np.concatenate([a_ND, b_ND])
  std_D = x_ND.std(0)
  return x_ND.mean(0), np.where(std_D > 0, std_D + 1e-6, 1.0)


@functools.partial(jax.jit, static_argnums=(5, 6, 7, 8, 9))
def _fit(params, a_ND, b_ND, y_N, perm_SB, loss, lr, weight_decay, alpha, warmup_frac):
  """params after one Adam(W) step per row of perm_SB (the batch's indices); compiled once
  per shape and setting, so seeds share it."""
  tx = optax.adamw(lr, weight_decay=weight_decay)
  total = perm_SB.shape[0]

  def loss_fn(params, idx_B, step):
    logits_B = pair_logits(params, a_ND[idx_B], b_ND[idx_B])
    if loss == "aux":
      return aux_conf_loss(logits_B, y_N[idx_B], alpha_at(step, total, alpha, warmup_frac))
    return soft_xent(logits_B, y_N[idx_B])

  def step(carry, xs):
    params, opt_state = carry
    i, idx_B = xs
    updates, opt_state = tx.update(jax.grad(loss_fn)(params, idx_B, i), opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), (jnp.arange(total), perm_SB))
  return params


def train_head(a_ND, b_ND, targets_N, *, loss: str, seed: int, hidden: int = 0,
               epochs: int = 4, batch_size: int = 32, lr: float = 1e-3,
               weight_decay: float = 1e-2, alpha: float = 0.75, warmup_frac: float = 0.2):
  """Trains a head on (A, B) pairs; returns predict(a_ND, b_ND) -> p(A preferred), numpy.

  loss "ground_truth" / "naive": soft_xent to targets_N (0/1 labels or weak soft labels);
  "aux": aux_conf_loss with alpha ramped in over warmup_frac of the steps. Seed: the init
  and the order of the shuffled batches (the last partial batch of an epoch is dropped).
  """
  if loss not in LOSSES:
    raise ValueError(f"loss={loss!r}; choose one of {LOSSES}")
  n = len(targets_N)
  if n < batch_size:
    raise ValueError(f"{n} training pairs is fewer than batch_size={batch_size}")
  mean_D, scale_D = standardizer(a_ND, b_ND)
  norm = lambda x: jnp.asarray((x - mean_D) / scale_D, jnp.float32)  # noqa: E731
  a, b, y = norm(a_ND), norm(b_ND), jnp.asarray(targets_N, jnp.float32)
  steps_per_epoch = n // batch_size
  rng = np.random.default_rng(seed)
  perm_SB = np.concatenate([rng.permutation(n)[:steps_per_epoch * batch_size]
                            for _ in range(epochs)]).reshape(-1, batch_size)
  params = init_head(jax.random.PRNGKey(seed), a.shape[1], hidden)
  params = _fit(params, a, b, y, jnp.asarray(perm_SB), "aux" if loss == "aux" else "xent",
                float(lr), float(weight_decay), float(alpha), float(warmup_frac))

  def predict(a_ND, b_ND):
    return np.asarray(jax.nn.sigmoid(pair_logits(params, norm(a_ND), norm(b_ND))))

  return predict


def accuracy(p_N, label_N) -> float:
  return float(np.mean((np.asarray(p_N) > 0.5) == (np.asarray(label_N) > 0.5)))


def run_seed(weak_chosen, weak_rejected, strong_chosen, strong_rejected, splits: dict,
             seed: int, head: dict, order_seed: int = 0, weak_train_pairs: int = 0) -> dict:
  """One seed of the whole protocol: {"weak", "naive", "aux", "ceiling"} test accuracies,
  the PGRs, the weak labels' accuracy on half B, and test predictions (for a bootstrap).
  `head`: train_head keywords for all heads (hidden, epochs, lr, ...). The presentation
  order is fixed by order_seed; `seed` varies every head's init and batch order, and with
  weak_train_pairs > 0 which pairs of half A the weak head sees (a weaker supervisor)."""
  wa, wb, label = present(weak_chosen, weak_rejected, order_seed)
  sa, sb, _ = present(strong_chosen, strong_rejected, order_seed)
  A, B, T = splits["a"], splits["b"], splits["test"]
  if weak_train_pairs:
    if not head.get("batch_size", 32) <= weak_train_pairs <= len(A):
      raise ValueError(f"weak_train_pairs={weak_train_pairs} must be in [batch_size, "
                       f"{len(A)}] (half A)")
    A = np.random.default_rng(seed).choice(A, weak_train_pairs, replace=False)
  weak = train_head(wa[A], wb[A], label[A], loss="ground_truth", seed=seed, **head)
  soft_B = weak(wa[B], wb[B])
  probs = {"weak": weak(wa[T], wb[T])}
  for name, loss, targets in (("naive", "naive", soft_B), ("aux", "aux", soft_B),
                              ("ceiling", "ground_truth", label[B])):
    fit = train_head(sa[B], sb[B], targets, loss=loss, seed=seed + 1000, **head)
    probs[name] = fit(sa[T], sb[T])
  acc = {k: accuracy(p, label[T]) for k, p in probs.items()}
  return dict(seed=seed, acc=acc, weak_label_acc=accuracy(soft_B, label[B]),
              pgr={m: pgr(acc["weak"], acc[m], acc["ceiling"]) for m in ("naive", "aux")},
              correct={k: ((p > 0.5) == (label[T] > 0.5)) for k, p in probs.items()})
