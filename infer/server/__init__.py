"""`meshlm serve`: OpenAI-compatible HTTP serving with a gray release (docs/serving.md)."""
