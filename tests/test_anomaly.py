"""Unit tests of the loop's failure bookkeeping: spike detection and goodput across restarts."""

import math

from train.fault import AnomalyDetector, Goodput


def test_spike_is_flagged_and_kept_out_of_the_window():
  detector = AnomalyDetector(window=20, zscore=6.0)
  for i in range(20):
    assert detector.check(3.0 + 0.01 * (i % 3), 1.0) is None
  reason = detector.check(6.0, 1.0)
  assert reason and reason.startswith("loss spike")
  assert 6.0 not in detector.history  # a spike must not widen the baseline
  assert detector.check(3.01, 1.0) is None


def test_non_finite_is_flagged_even_without_history():
  detector = AnomalyDetector(window=20, zscore=0.0)
  assert detector.check(math.nan, 1.0) == "non-finite loss or gradient"
  assert detector.check(1.0, math.inf) == "non-finite loss or gradient"
  assert detector.check(1e9, 1.0) is None  # zscore 0: spike detection off


def test_goodput_counts_recomputed_steps_after_a_restart(tmp_path):
  first = Goodput(str(tmp_path))
  for step in range(1, 11):
    first.step_done(step, 1.0)
  first.add("checkpoint", 2.0)
  first.save()
  second = Goodput(str(tmp_path))  # restarted from a checkpoint at step 6
  for step in range(7, 13):
    second.step_done(step, 1.0)
  summary = second.summary()
  assert summary["restarts"] == 1
  assert summary["seconds"]["recompute"] == 4.0  # steps 7-10 ran twice
  assert summary["seconds"]["train"] == 12.0
  assert abs(summary["goodput"] - 12.0 / 18.0) < 1e-12


def test_metrics_writer_drops_a_torn_last_line(tmp_path):
  from train.metrics import MetricsWriter
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
  writer = MetricsWriter(str(tmp_path), total_steps=3, initial_step=2)
  writer.write(3, {"loss": 1.5})
  writer.close()
  assert path.read_text().splitlines() == ['{"step": 1, "loss": 2.0}', '{"step": 3, "loss": 1.5}']
