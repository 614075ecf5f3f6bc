"""`meshlm embed`: sentence embeddings of a file's texts from an encoder model.

  meshlm embed --model DIR --input FILE [--text_key text] [--output FILE.npy|.jsonl]
               [--batch_size 32] [--max_len N]

--input is a .txt file (one text per line; blank lines are skipped) or a .jsonl
file whose records hold the text under --text_key. Prints a JSON summary.
"""

import json

from absl import flags

from cli.parsing import parse, require, require_paths
from infer.embed import embed_file


def make_flags(argv: list[str]) -> flags.FlagValues:
  del argv  # no --config here
  fv = flags.FlagValues()
  flags.DEFINE_string("model", None, "encoder checkpoint: HF / sentence-transformers directory "
                      "or meshlm workdir", flag_values=fv)
  flags.DEFINE_string("input", None, ".txt (one text per line) or .jsonl file", flag_values=fv)
  flags.DEFINE_string("text_key", "text", ".jsonl: the field holding the text", flag_values=fv)
  flags.DEFINE_string("output", None, "where to write the embeddings: .npy or .jsonl",
                      flag_values=fv)
  flags.DEFINE_integer("batch_size", 32, "texts per forward pass", flag_values=fv)
  flags.DEFINE_integer("max_len", None, "tokens per text, [CLS] and [SEP] included (default: "
                       "the model's max_seq_length)", flag_values=fv)
  return fv


def main(argv: list[str], command: str = "embed") -> None:
  """`meshlm embed ARGS`: argv is everything after `embed`."""
  fv = make_flags(argv)
  parse(command, argv, fv, __doc__)
  require(command, fv, "model", "input")
  require_paths(command, fv, "model", "input")
  try:
    summary = embed_file(fv["model"].value, fv["input"].value, text_key=fv["text_key"].value,
                         output=fv["output"].value, batch_size=fv["batch_size"].value,
                         max_len=fv["max_len"].value)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"meshlm {command}: error: {e}") from e
  print(json.dumps(summary))
