"""`meshlm serve` started on a family's Hugging Face directory, as a user starts it, answers
over real HTTP with the tokens the Engine gives the same directory: Gemma 2 (local/global
layers, soft caps), Qwen2-MoE (routed experts and a gated shared expert) and DeepSeek-V3
(latent attention, its paged cache holding the latent only), the families whose serving path
differs most from Llama's."""

import pytest

import deps

deps.require("torch")
deps.require("transformers")

from benchmarks.family_parity import make_family  # noqa: E402
from infer import Engine, SamplingParams  # noqa: E402
from serve_util import ServeProcess  # noqa: E402

PROMPT = "w5 w17 w33 w8 w91 w12"
TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s> assistant {% endif %}")


@pytest.mark.parametrize("name", ["gemma2", "qwen2_moe", "deepseek_v3"])
def test_meshlm_serve_answers_with_the_engines_tokens(tmp_path, name):
  directory = str(tmp_path / name)
  _, model, tokenizer = make_family(name, directory, chat_template=TEMPLATE)
  engine = Engine(model, tokenizer, max_seq_len=64, max_batch=1)
  (want,) = engine.generate([tokenizer.encode(PROMPT)],
                            SamplingParams(max_tokens=6, ignore_eos=True))
  server = ServeProcess(["--model", directory, "--max_model_len", "64", "--max_num_seqs", "2",
                         "--max_tokens", "16"], str(tmp_path / "serve.log"))
  try:
    with server.client() as client:
      model_id = client.get("/v1/models").json()["data"][0]["id"]
      reply = client.post("/v1/completions", json={
          "model": model_id, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
          "ignore_eos": True})
      chat = client.post("/v1/chat/completions", json={
          "model": model_id, "messages": [{"role": "user", "content": PROMPT}],
          "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == tokenizer.decode(want.token_ids)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] >= 1
  finally:
    server.stop()
