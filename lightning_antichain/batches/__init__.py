"""A batch and its micro-batches: where the samples are, the split into micro-batches, the join of their
outputs and of a model's own loss, and the check that samples do not depend on each other.
"""
