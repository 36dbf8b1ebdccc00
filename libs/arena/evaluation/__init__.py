"""Evaluation jobs over a dataset: statistics, the job, cost and reports (docs/evaluation.md)."""
