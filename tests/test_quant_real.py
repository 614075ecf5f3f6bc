"""GPTQ against round-to-nearest on a real model (SmolLM2-135M-Instruct) and real held-out text."""

import numpy as np

import deps
from benchmarks.quant import chunks, perplexity, smollm_texts

SMOLLM = deps.smollm()
# The MLP output projections of all 30 layers at int4-g128 (1536-wide inputs: no group
# fitting), calibrated on alpaca-eval answers [0, 400) and scored on answers [600, 805).
RULES = [("down_FD", "int4-g128")]


def test_gptq_beats_round_to_nearest_on_held_out_text():
  import jax.numpy as jnp
  from infer.quant import quantize_model
  from infer.quant.gptq import gptq_quantize
  from models import load_pretrained

  calib_text, eval_text = smollm_texts()
  model, tok = load_pretrained(SMOLLM)
  calib = chunks(tok.encode(calib_text, add_bos=False), 16, 128)
  held = chunks(tok.encode(eval_text, add_bos=False), 8, 128)
  ref = np.asarray(model(jnp.asarray(held)))
  results = {}
  for method in ("rtn", "gptq"):
    model, _ = load_pretrained(SMOLLM)
    if method == "rtn":
      quantize_model(model, RULES)
    else:
      gptq_quantize(model, RULES, calib, act_order=True)
    out = np.asarray(model(jnp.asarray(held)))
    results[method] = (float(np.sqrt(((out - ref) ** 2).mean())), perplexity(model, held))
  print(results)
  (rtn_err, rtn_ppl), (gptq_err, gptq_ppl) = results["rtn"], results["gptq"]
  assert gptq_err < rtn_err and gptq_ppl < rtn_ppl, results
