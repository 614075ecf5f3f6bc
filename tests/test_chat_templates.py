"""Each family's real chat template (data/chat_templates/: Llama 3.1 (3.3's is the same file) and 3.2,
Qwen2.5, Qwen3, Gemma 2, Mistral Nemo, Phi-3.5, DeepSeek-V3.1, as their repositories hold them) renders the same text with
meshlm's tokenizer (what `meshlm generate --chat`, `meshlm serve` and alignment data use) as
with transformers' apply_chat_template, and refuses what it refuses."""

import os

import jinja2
import pytest
import tokenizers

import deps

transformers = deps.require("transformers")

from models.tokenizer import Tokenizer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(REPO, "data", "chat_templates")
# template file -> (bos, eos) as the model's tokenizer_config.json names them
SPECIALS = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": (None, "<|im_end|>"),
    "Qwen-Qwen3-0.6B.jinja": (None, "<|im_end|>"),
    "google-gemma-2-2b-it.jinja": ("<bos>", "<eos>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("<s>", "</s>"),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("<s>", "<|end|>"),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
}
SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "Name a prime."}],
    "system": [SYSTEM, {"role": "user", "content": "Name a prime."}],
    "multi_turn": [{"role": "user", "content": "Name a prime."},
                   {"role": "assistant", "content": "7"},
                   {"role": "user", "content": "And one above 10 <with> \"quotes\" & é?"}],
    "ends_with_assistant": [SYSTEM, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello."}],
}


def tokenizers_pair(name):
  bos, eos = SPECIALS[name]
  with open(os.path.join(FOLDER, name)) as f:
    template = f.read()
  specials = [t for t in (bos, eos, "<unk>") if t]
  vocab = {t: i for i, t in enumerate(specials)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.add_special_tokens(specials)
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                                eos_token=eos, unk_token="<unk>",
                                                chat_template=template)
  ours = Tokenizer(tok, bos_id=vocab.get(bos), eos_id=vocab[eos], chat_template=template)
  return ours, theirs


def render(tokenizer, messages, generation):
  try:
    if isinstance(tokenizer, Tokenizer):
      return tokenizer.apply_chat_template(messages, generation)
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation)
  except jinja2.exceptions.TemplateError as e:
    return f"TemplateError: {e}"


@pytest.mark.parametrize("name", sorted(SPECIALS))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("generation", [True, False], ids=["generation_prompt", "no_prompt"])
def test_renders_as_transformers_does(name, conversation, generation):
  ours, theirs = tokenizers_pair(name)
  messages = CONVERSATIONS[conversation]
  want = render(theirs, messages, generation)
  assert render(ours, messages, generation) == want
  assert want.strip()  # the template rendered (or refused) something


def test_the_templates_differ_where_families_do():
  """Every template renders the one-turn conversation its own way (a file mix-up shows; Llama
  3.2 prints today's date where 3.1 prints a fixed one)."""
  texts = {render(tokenizers_pair(n)[0], CONVERSATIONS["one_turn"], True) for n in SPECIALS}
  assert len(texts) == len(SPECIALS)
