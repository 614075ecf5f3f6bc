"""benchmarks/vs_llamacpp.py's own parts (the peer itself is a benchmark's, not the tests')."""

import numpy as np
import pytest
import torch

from benchmarks import vs_llamacpp
from test_kv_cache import CharTokenizer, tiny_model

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 3


@pytest.mark.parametrize("bos", [None, 1])
def test_window_perplexity_scores_each_windows_second_half_as_llama_perplexity(bos):
  """llama-perplexity's scoring, recomputed with torch from the model's own logits: windows of
  n_ctx tokens (the rest dropped), the first token BOS where the tokenizer adds one, and the
  next-token NLL of positions n_ctx/2 + 1 .. n_ctx - 1 only."""
  model, tok, n_ctx = tiny_model(vocab_size=128), CharTokenizer(), 32  # printable ASCII
  tok.bos_id, tok.add_bos = bos, bos is not None
  got = vs_llamacpp.window_perplexity(model, tok, TEXT, n_ctx, batch=3)
  ids = np.asarray(tok.encode(TEXT))
  n = len(ids) // n_ctx
  windows = ids[:n * n_ctx].reshape(n, n_ctx).copy()
  if bos is not None:
    windows[:, 0] = bos
  logits = torch.tensor(np.asarray(model(windows)), dtype=torch.float64)
  first = n_ctx // 2
  nll = torch.nn.functional.cross_entropy(logits[:, first:-1].reshape(-1, logits.shape[-1]),
                                          torch.tensor(windows[:, first + 1:]).reshape(-1))
  assert got["chunks"] == n == len(ids) // 32
  np.testing.assert_allclose(got["ppl"], float(torch.exp(nll)), rtol=1e-5)


def test_a_missing_peer_is_named(tmp_path):
  (tmp_path / "llama-bench").write_text("")
  with pytest.raises(SystemExit, match="lacks llama-perplexity, llama-quantize"):
    vs_llamacpp.llama_bin(str(tmp_path))
