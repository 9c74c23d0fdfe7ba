"""The in-process runtime: one process drives every stage of its pipeline, GPipe's schedule on worker
threads, and runs a LightningModule's steps through it (the default).
"""
