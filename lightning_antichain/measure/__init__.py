"""Clocks and counters: what an operation, a stage's action and a link take, the memory a forward keeps
for backward, and the CPU threads a stage is measured and run with.
"""
