"""Stages cut out of a captured graph by a plan, with what both runtimes need in them: deferred BatchNorm
statistics, random numbers drawn again on recompute, and tied parameters.
"""
