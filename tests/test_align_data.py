"""align/data.py, align/logprobs.py, align/heads.py: parsing, masks, batches, log-probs, heads."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

from align import data as D
from align.heads import RewardModel, last_response_index
from align.logprobs import forward_logps, sequence_logps, split_pairs, token_logps
from models import ModelConfig, Transformer
from models.tokenizer import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HH_SLICE = os.path.join(REPO, "data", "hh-rlhf", "helpful-base-test-slice.jsonl")
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{'<|im_start|>assistant\n'}}{% endif %}")
CFG = dict(vocab_size=258, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48,
           max_seq_len=64)
CONVO = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Héllo!"},
         {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok then"}]


def byte_tokenizer(template):
  """Byte-level BPE without merges (ids 0-255 are bytes) + <|im_start|> 256, <|im_end|> 257
  (EOS): every text round-trips exactly."""
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, []))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
  return Tokenizer(tok, bos_id=256, eos_id=257, chat_template=template)


@pytest.fixture(scope="module", params=["template", "plain"])
def tok(request):
  return byte_tokenizer(CHATML if request.param == "template" else None)


@pytest.fixture(scope="module")
def model():
  return Transformer(ModelConfig(**CFG), nnx.Rngs(0))


def _runs(mask_N):
  """[start, end) of each run of ones."""
  edges = np.diff(np.concatenate([[0], mask_N, [0]]))
  return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def test_hh_rows_parse_into_alternating_turns_and_a_shared_prompt():
  with open(HH_SLICE) as f:
    rows = [json.loads(line) for line in f]
  for row in rows[:30]:
    pair = D.pair_from_record(row)
    msgs = D.parse_hh(row["chosen"])
    assert list(pair.prompt) == msgs[:-1] and pair.chosen == msgs[-1]["content"]
    assert pair.rejected == D.parse_hh(row["rejected"])[-1]["content"] != pair.chosen
    assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)
    rebuilt = "".join(f"\n\n{'Human' if m['role'] == 'user' else 'Assistant'}: {m['content']}"
                      for m in msgs)
    assert " ".join(rebuilt.split()) == " ".join(row["chosen"].split())
  assert D.parse_hh(rows[0]["chosen"])[0] == {
      "role": "user", "content": rows[0]["chosen"].split("\n\nAssistant:")[0][len("\n\nHuman: "):]}


def test_sft_mask_is_exactly_the_assistant_text_and_eos(tok):
  ids, mask = D.tokenize_sft(tok, CONVO, max_len=200)
  lead = "" if tok.chat_template else " "  # plain format: the space belongs to the response
  runs = _runs(mask)
  assert [tok.decode(ids[a:b], skip_special_tokens=False) for a, b in runs] == \
      [lead + "Héllo!<|im_end|>", lead + "ok then<|im_end|>"]
  assert all(ids[b - 1] == tok.eos_id for _, b in runs) and runs[-1][1] == len(ids)
  prompt = D.render(tok, CONVO[:1])
  assert tok.decode(ids[:runs[0][0]], skip_special_tokens=False) == prompt
  with pytest.raises(D.BadRecord, match="too_long"):
    D.tokenize_sft(tok, CONVO, max_len=len(ids) - 2)


def test_pair_rows_share_the_prompt_and_mask_only_the_final_response(tok):
  (c_ids, c_mask), (r_ids, r_mask), dropped = D.tokenize_pair(tok, CONVO[:3], "yes", "no", 200)
  assert dropped == 0
  n = len(c_ids) - int(c_mask.sum())
  assert n == len(r_ids) - int(r_mask.sum()) and np.array_equal(c_ids[:n], r_ids[:n])
  lead = "" if tok.chat_template else " "
  assert tok.decode(c_ids[n:], skip_special_tokens=False) == lead + "yes<|im_end|>"
  assert tok.decode(r_ids[n:], skip_special_tokens=False) == lead + "no<|im_end|>"
  # Too long: the oldest (user, assistant) turn goes, the last user turn stays.
  short, _, dropped = D.tokenize_pair(tok, CONVO[:3], "yes", "no", len(c_ids) - 2)
  assert dropped == 1 and tok.decode(short[0], skip_special_tokens=False).count("more") == 1
  assert "Hi there" not in tok.decode(short[0])
  with pytest.raises(D.BadRecord, match="too_long"):
    D.tokenize_pair(tok, CONVO[:3], "yes", "no", len(c_ids) - 2, drop_turns=False)


def test_every_bad_record_is_skipped_and_counted(tmp_path):
  tok = byte_tokenizer(CHATML)
  bad = [{"prompt": "q", "chosen": "a"}, {"prompt": "q", "chosen": "", "rejected": "b"},
         {"prompt": "q", "chosen": "same", "rejected": "same"},
         {"prompt": "q " * 3000, "chosen": "a", "rejected": "b"},
         {"chosen": "no markers", "rejected": "x"}, {"prompt": "q", "chosen": "a", "rejected": "b"}]
  path = tmp_path / "pairs.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in bad) + "\n{not json\n")
  pairs, report = D.load_pairs([HH_SLICE, str(path)], tok, max_len=4096)
  assert report.skipped == {"unparseable": 2 + 2, "prompt_mismatch": 1, "identical_pair": 1 + 1,
                            "empty_response": 1 + 1, "missing_fields": 1, "too_long": 1}
  assert report.kept == len(pairs) == 30 + 1 and report.total == 35 + 7
  report.check()
  sft = tmp_path / "sft.jsonl"
  sft.write_text("\n".join(json.dumps(r) for r in [
      {"messages": CONVO}, {"prompt": "q", "response": "a"}, {"prompt": "q", "response": " "},
      {"messages": CONVO[:3]}, {"text": "x"}, {"messages": [CONVO[1], CONVO[0]]}]))
  examples, report = D.load_sft(str(sft), tok, max_len=512)
  assert len(examples) == report.kept == 2
  assert report.skipped == {"empty_response": 1, "unparseable": 2, "missing_fields": 1}
  with pytest.raises(ValueError, match="refusing to train"):
    report.check(max_skipped_fraction=0.5)


def test_packing_keeps_examples_whole_with_their_own_segments():
  rng = np.random.default_rng(0)
  examples = [(rng.integers(0, 256, n).astype(np.int32), (np.arange(n) % 3 == 0).astype(np.int32))
              for n in (9, 5, 13, 3, 7, 17, 2)]
  batch = D.pack_sft(examples, seq_len=16)
  assert {k: v.shape for k, v in batch.items()} == {k: (4, 16) for k in D.FIELDS}
  segments = {}  # inputs -> (row, columns)
  for row in range(4):
    seg_T = batch["segment_ids"][row]
    assert list(seg_T[seg_T > 0]) == sorted(seg_T[seg_T > 0])  # contiguous, 1, 2, ...
    for s in range(1, seg_T.max() + 1):
      cols = np.flatnonzero(seg_T == s)
      assert np.array_equal(cols, np.arange(cols[0], cols[-1] + 1))
      assert np.array_equal(batch["positions"][row, cols], np.arange(len(cols)))
      segments[tuple(batch["inputs"][row, cols])] = (row, cols)
    assert not batch["loss_mask"][row][seg_T == 0].any()
  assert len(segments) == len(examples)
  for ids, mask in examples:  # each example whole, in one segment
    row, cols = segments[tuple(ids[:-1])]
    assert np.array_equal(batch["targets"][row, cols], ids[1:])
    assert np.array_equal(batch["loss_mask"][row, cols], mask[1:])
  # First fit over input lengths 8 4 12 2 6 16 1: row 0 takes 8, 4, 2, 1; then 12 | 6 | 16.
  assert [int(batch["segment_ids"][r].max()) for r in range(4)] == [4, 1, 1, 1]
  with pytest.raises(ValueError, match="do not fit seq_len=16"):
    D.pack_sft([(np.zeros(18, np.int32), np.ones(18, np.int32))], 16)


def _pairs(tok):
  return [D.tokenize_pair(tok, CONVO[:3], "yes", "no thanks", 40)[:2],
          D.tokenize_pair(tok, CONVO[:1], "Sure.", "Nope", 40)[:2]]


def test_sequence_logps_count_response_tokens_only(model):
  tok = byte_tokenizer(CHATML)
  pairs = _pairs(tok)
  batch = D.pair_batch(pairs, seq_len=64)
  logps_2B = np.asarray(sequence_logps(model, batch))
  # Reference: each unpadded row alone, summing log p over its response tokens by hand.
  for row, (ids, mask) in enumerate([p[0] for p in pairs] + [p[1] for p in pairs]):
    logits = model(jnp.asarray(ids[None, :-1]))[0]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    want = sum(float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1) if mask[t + 1])
    np.testing.assert_allclose(logps_2B[row], want, rtol=0, atol=1e-5)
  # Prompt targets and padding (inputs and targets) may be anything: nothing changes.
  changed = {k: v.copy() for k, v in batch.items()}
  counted = (batch["segment_ids"] > 0) & (batch["loss_mask"] > 0)
  changed["targets"][~counted] = 7
  changed["inputs"][batch["segment_ids"] == 0] = 123
  np.testing.assert_array_equal(np.asarray(sequence_logps(model, changed)), logps_2B)
  graphdef, params = nnx.split(model)
  np.testing.assert_allclose(jax.jit(forward_logps)(graphdef, params, batch), logps_2B,
                             rtol=0, atol=1e-6)


def test_chosen_and_rejected_together_equal_separate_passes(model):
  tok = byte_tokenizer(None)
  pairs = _pairs(tok)
  chosen_B, rejected_B = split_pairs(sequence_logps(model, D.pair_batch(pairs, seq_len=64)))
  # One row at a time, with less padding: equal to 1e-6 relative, a few float32 ulps of the
  # sums (~ -60): XLA sums in another order when the batch shape changes.
  for b, (chosen, rejected) in enumerate(pairs):
    alone = {k: v[:1] for k, v in D.pair_batch([(chosen, chosen)], seq_len=48).items()}
    np.testing.assert_allclose(sequence_logps(model, alone)[0], chosen_B[b], rtol=1e-6, atol=0)
    alone = {k: v[:1] for k, v in D.pair_batch([(rejected, rejected)], seq_len=48).items()}
    np.testing.assert_allclose(sequence_logps(model, alone)[0], rejected_B[b], rtol=1e-6,
                               atol=0)
  with pytest.raises(ValueError, match="even leading dimension"):
    split_pairs(jnp.zeros(3))


def test_token_logps_is_a_float32_log_softmax_gather():
  logits_BTV = jnp.asarray([[[0.0, np.log(3.0)], [2.0, 2.0]]], jnp.bfloat16)
  out = token_logps(logits_BTV, jnp.asarray([[1, 0]]))
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, [[np.log(0.75), np.log(0.5)]], rtol=0, atol=2e-3)


def test_reward_model_reads_the_last_response_token():
  cfg = ModelConfig(**CFG)
  rm = RewardModel.create(cfg, nnx.Rngs(1), head_std=0.5)
  assert rm.head.w.get_metadata()["out_sharding"] == ("embed",)
  assert float(RewardModel.create(cfg, nnx.Rngs(1)).head.w[...].std()) == 0.0
  batch = D.pair_batch(_pairs(byte_tokenizer(CHATML)), seq_len=64)
  last_B = np.asarray(last_response_index(batch))
  lengths = (batch["segment_ids"] > 0).sum(-1)
  np.testing.assert_array_equal(last_B, lengths - 1)  # the input before the final target (EOS)
  rewards_B = np.asarray(rm(batch))
  values_BT = np.asarray(rm.values(batch["inputs"], batch["positions"], batch["segment_ids"]))
  np.testing.assert_allclose(rewards_B, values_BT[np.arange(4), last_B], rtol=0, atol=1e-6)
  padded = {k: v.copy() for k, v in batch.items()}
  padded["inputs"][batch["segment_ids"] == 0] = 99
  np.testing.assert_array_equal(np.asarray(rm(padded)), rewards_B)
  edited = {k: v.copy() for k, v in batch.items()}
  edited["inputs"][0, last_B[0]] = (edited["inputs"][0, last_B[0]] + 1) % 256
  changed = np.asarray(rm(edited))
  assert changed[0] != rewards_B[0] and np.array_equal(changed[1:], rewards_B[1:])
