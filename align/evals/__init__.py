"""Helpful / harmless / honest evaluation, red teaming and the regression gate (docs/evals.md).

`meshlm eval --model PATH --suite hhh|helpful|harmless|honest|redteam --out DIR` writes
report.json (every metric with its sample size and bootstrap 95% CI) and report.html;
`meshlm gate --baseline A --candidate B` compares two reports.
"""
