"""Tokenizer: a `tokenizers.Tokenizer` plus special ids and the model's chat template."""

import datetime
import functools
import json
import os
from typing import Sequence

import jinja2
import jinja2.sandbox
import tokenizers

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # transformers' filter, not Jinja's (which escapes <, >, & and ' for HTML): tool schemas in
  # Llama 3.x's and Qwen's templates must print as transformers prints them
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  # Llama 3.1-3.3 print today's date where this exists (as in transformers), else a fixed one
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str):
  """A chat template compiled once (compiling dominated rendering thousands of examples), in
  the environment transformers' apply_chat_template renders it in."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


class Tokenizer:
  """Encodes/decodes text; renders chat messages with the model's Jinja chat template."""

  def __init__(self, tok: tokenizers.Tokenizer, bos_id: int | None = None,
               eos_id: int | None = None, pad_id: int | None = None,
               chat_template: str | None = None, add_bos: bool = False,
               max_len: int | None = None):
    # A tokenizer.json may carry padding/truncation settings (BERT's pads every text to 128
    # tokens); we pad batches ourselves and never drop tokens silently, so both are off.
    tok.no_padding()
    tok.no_truncation()
    self.tok = tok
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
    self.chat_template = chat_template
    self.add_bos = add_bos
    self.max_len = max_len  # longest input the model takes (sentence-transformers' max_seq_length)

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    ids = self.tok.encode(text, add_special_tokens=False).ids
    add_bos = self.add_bos if add_bos is None else add_bos
    if add_bos and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def encode_special(self, text: str, max_len: int | None = None) -> list[int]:
    """Ids with tokenizer.json's post-processor specials ([CLS] text [SEP] for BERT), the text
    cut so that the whole fits max_len, as transformers' truncation=True does."""
    enc = self.tok.encode(text, add_special_tokens=False)
    if max_len is not None:
      room = max_len - self.tok.num_special_tokens_to_add(is_pair=False)
      if room < 1:
        raise ValueError(f"max_len={max_len} leaves no room for text between the special tokens")
      enc.truncate(room)
    return self.tok.post_process(enc).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def token_text(self, token_id: int) -> str | None:
    return self.tok.id_to_token(token_id)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Renders messages the way Hugging Face does: a sandboxed Jinja template."""
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template; pass a plain prompt instead")
    template = _compiled_template(self.chat_template)
    special = lambda i: self.tok.id_to_token(i) if i is not None else ""
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=special(self.bos_id), eos_token=special(self.eos_id),
                           pad_token=special(self.pad_id))

  def save(self, directory: str) -> None:
    """Writes tokenizer.json and a small metadata file (special ids, chat template)."""
    os.makedirs(directory, exist_ok=True)
    self.tok.save(os.path.join(directory, TOKENIZER_FILE))
    meta = dict(bos_id=self.bos_id, eos_id=self.eos_id, pad_id=self.pad_id,
                chat_template=self.chat_template, add_bos=self.add_bos, max_len=self.max_len)
    with open(os.path.join(directory, META_FILE), "w") as f:
      json.dump(meta, f, indent=1)

  @classmethod
  def load(cls, directory: str) -> "Tokenizer":
    """Loads what `save` wrote, or a Hugging Face directory (tokenizer_config.json)."""
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.exists(path):
      raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}")
    tok = tokenizers.Tokenizer.from_file(path)
    meta_path = os.path.join(directory, META_FILE)
    if os.path.exists(meta_path):
      with open(meta_path) as f:
        return cls(tok, **json.load(f))
    return cls._from_hf_config(tok, directory)

  @classmethod
  def _from_hf_config(cls, tok: tokenizers.Tokenizer, directory: str) -> "Tokenizer":
    cfg = {}
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(cfg_path):
      with open(cfg_path) as f:
        cfg = json.load(f)

    def token_id(key):
      value = cfg.get(key)
      if isinstance(value, dict):
        value = value.get("content")
      return tok.token_to_id(value) if value else None

    template = cfg.get("chat_template")
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.exists(jinja_path):
      with open(jinja_path) as f:
        template = f.read()
    return cls(tok, bos_id=token_id("bos_token"), eos_id=token_id("eos_token"),
               pad_id=token_id("pad_token"), chat_template=template,
               add_bos=bool(cfg.get("add_bos_token", False)))
