"""Weights from nothing to a trained checkpoint: a model built without memory, made real stage by stage,
initialised, loaded from checkpoint files or shards, and its optimizer state beside its parameters.
"""
