"""Experiment configs: each NAME.py defines get_config() -> ml_collections.ConfigDict."""
