"""The process runtime: one process per stage on torch.distributed.pipelining, each holding its own
stages, and a LightningModule's steps run once per micro-batch on the last stage's rank (schedule=).
"""
