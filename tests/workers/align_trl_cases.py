"""align/ losses against TRL's own code on the same inputs (trl is a test dependency).

Collected by tests/test_align_trl.py in a process of its own: importing trl brings in
datasets and pyarrow, which the main test process never needs to load."""

import importlib
import types
from collections import defaultdict

import jax.numpy as jnp
import numpy as np

from align import preference, rl
from train import distillation

RNG = np.random.default_rng(1)

# --- TRL's own code on the same inputs -------------------------------------------------------


def test_dpo_matches_trl():
  """TRL 1.x inlines its DPO loss in DPOTrainer._compute_loss (there is no dpo_loss
  method any more), so run that method on a bare trainer object holding the
  attributes it reads, with two tiny random Llama models as policy and reference.
  Our loss gets log-probs summed over completion tokens, computed here in torch."""
  torch = importlib.import_module("torch")
  trl_dpo = importlib.import_module("trl.trainer.dpo_trainer")
  from accelerate import Accelerator
  from transformers import LlamaConfig, LlamaForCausalLM
  from trl.trainer.utils import add_fused_lm_head

  cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
  torch.manual_seed(0)
  policy, ref = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
  B, T = 3, 10
  input_ids = torch.randint(0, 32, (2 * B, T))  # rows: B chosen, then B rejected
  attention = torch.ones(2 * B, T, dtype=torch.long)
  completion = torch.zeros(2 * B, T, dtype=torch.long)
  for row, (start, end) in enumerate([(3, 10), (4, 8), (2, 6), (3, 9), (4, 10), (2, 3)]):
    completion[row, start:end] = 1
    attention[row, end:] = 0  # right padding

  def summed_logps(model):
    with torch.no_grad():
      logits = model(input_ids=input_ids, attention_mask=attention).logits.double()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return (lp * completion[:, 1:]).sum(1).numpy()

  pol, rf = summed_logps(policy), summed_logps(ref)
  lengths = completion.sum(1).numpy()
  add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
  add_fused_lm_head(ref)
  policy.train()  # TRL logs under "train"; the tiny Llama has no dropout

  # ("sigmoid", 0.1): TRL 1.x ignores label_smoothing for "sigmoid" (ours then applies the
  # cDPO form, checked against the closed form above), so its loss equals ours at ε = 0.
  for loss_type, eps in [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0),
                         ("robust", 0.1)]:
    trainer = object.__new__(trl_dpo.DPOTrainer)
    trainer.__dict__.update(
        model=policy, ref_model=ref, accelerator=Accelerator(cpu=True), aux_loss_enabled=False,
        precompute_ref_logps=False, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=0.7, label_smoothing=eps, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    inputs = dict(input_ids=input_ids, attention_mask=attention, completion_mask=completion)
    with torch.no_grad():
      trl_loss = float(trainer._compute_loss(policy, inputs, return_outputs=False))
    kw = dict(chosen_lengths_B=lengths[:B], rejected_lengths_B=lengths[B:]) if loss_type == "ipo" else {}
    ours_eps = 0.0 if loss_type == "sigmoid" else eps
    loss_B, m = preference.dpo_loss(pol[:B], pol[B:], rf[:B], rf[B:], beta=0.7, loss_type=loss_type,
                                    label_smoothing=ours_eps, **kw)
    np.testing.assert_allclose(float(jnp.mean(loss_B)), trl_loss, rtol=2e-5, err_msg=loss_type)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "logps/chosen", "logps/rejected"):
      np.testing.assert_allclose(float(m[key]), trainer._metrics["train"][key][0], rtol=2e-5, atol=1e-6,
                                 err_msg=f"{loss_type} {key}")


def test_reward_loss_matches_trl_formula_on_torch():
  """TRL's RewardTrainer.compute_loss needs a sequence-classification model; its loss
  is the two lines at trl/trainer/reward_trainer.py compute_loss, checked here for
  presence and evaluated with torch on the same numbers."""
  torch = importlib.import_module("torch")
  trl_rm = importlib.import_module("trl.trainer.reward_trainer")
  import inspect
  src = inspect.getsource(trl_rm.RewardTrainer.compute_loss)
  assert "logsigmoid(rewards_chosen - rewards_rejected - inputs[\"margin\"]).mean()" in src
  assert "center_rewards_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)" in src
  rc, rr, margin = (torch.tensor(RNG.normal(size=6)) for _ in range(3))
  expected = (-torch.nn.functional.logsigmoid(rc - rr - margin).mean()
              + 0.01 * torch.mean((rc + rr) ** 2))
  loss, _ = preference.reward_loss(rc.numpy(), rr.numpy(), margin_B=margin.numpy(), center_coef=0.01)
  np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)


def test_distill_matches_trl_gkd_forward_kl():
  """TRL's generalized_jsd_loss with beta=0 is KL(teacher‖student) at a temperature,
  averaged over non-ignored tokens; ours is that times T² when alpha = 1."""
  torch = importlib.import_module("torch")
  gkd = importlib.import_module("trl.experimental.gkd")
  s, t = RNG.normal(size=(2, 4, 7)), RNG.normal(size=(2, 4, 7)) * 3
  mask = np.array([[1, 1, 1, 0], [0, 1, 1, 1]])
  targets = RNG.integers(0, 7, (2, 4))
  labels = torch.tensor(np.where(mask > 0, targets, -100))
  T = 2.0
  trl_kl = gkd.GKDTrainer.generalized_jsd_loss(torch.tensor(s), torch.tensor(t), labels=labels, beta=0.0,
                                               temperature=T, reduction="batchmean")
  loss, m = distillation.distill_loss(s, t, targets, mask, temperature=T, alpha=1.0)
  np.testing.assert_allclose(float(m["kl"]), float(trl_kl), rtol=1e-5)
  np.testing.assert_allclose(float(loss), T * T * float(trl_kl), rtol=1e-5)


def test_grpo_advantages_match_trl_nanstd():
  torch = importlib.import_module("torch")
  trl_utils = importlib.import_module("trl.trainer.utils")
  rewards = RNG.normal(size=(4, 8))
  r = torch.tensor(rewards)
  expected = (r - r.mean(1, keepdim=True)) / (trl_utils.nanstd(r, dim=1, keepdim=True) + 1e-4)
  np.testing.assert_allclose(rl.grpo_advantages(rewards), expected.numpy(), rtol=1e-5, atol=1e-6)
