"""Data curation: the teacher judge, preference pairs, the human review queue and page,
Self-Instruct and the prompt pool."""
