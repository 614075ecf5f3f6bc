"""The CLI's persistent compilation cache (cli/main.py): a repeated command compiles nothing
and prints what the first printed; another model compiles anew; off means off (issue 56).
Start-up times are benchmarks/startup.py's, not a test's."""

import os

import pytest

from conftest import meshlm, train_tiny


def cache_env(cache) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  return dict(env, MESHLM_COMPILATION_CACHE=str(cache))


def entries(cache) -> set[str]:
  return set(os.listdir(cache)) if os.path.isdir(cache) else set()


def generate(model, env):
  out = meshlm("generate", "--model", model, "--prompt", "ROMEO:", "--max_new_tokens", "6",
               env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


@pytest.fixture(scope="module")
def two_layer_run(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("cache") / "run2")
  out = train_tiny(path, "--config.steps=2", "--config.model.num_layers=2")
  assert out.returncode == 0, out.stderr[-3000:]
  return path


def test_a_repeat_hits_the_cache_and_another_model_compiles(tiny_run, two_layer_run, tmp_path):
  cache = tmp_path / "jax-cache"
  env = cache_env(cache)
  first = generate(tiny_run, env)
  cold = entries(cache)
  assert cold, "the first run wrote no compiled programs"
  assert generate(tiny_run, env) == first
  assert entries(cache) == cold, "a repeated command compiled again"
  generate(two_layer_run, env)  # other shapes: other programs, never the 1-layer ones
  assert entries(cache) - cold


def test_off_writes_nothing(tiny_run, tmp_path):
  env = cache_env("off")
  env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")  # where the default cache would go
  generate(tiny_run, env)
  assert not os.path.exists(tmp_path / "xdg")
