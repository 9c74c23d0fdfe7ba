"""Small real models for the runtime tests, each with a shape the pipeline must get right."""

import torch
from torch import nn


class SequentialCNN(nn.Sequential):
    def __init__(self):
        super().__init__(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.Tanh(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(64, 10),
        )


class LongSkip(nn.Module):
    """The stem's output is added back after four more layers: the skip spans several stages."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(12, 16)
        self.body = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        skip = torch.tanh(self.stem(x))
        h = skip
        for layer in self.body:
            h = torch.relu(layer(h))
        return self.head(h + skip)


class InceptionBlock(nn.Module):
    """Four parallel branches joined by a concatenation, twice."""

    def __init__(self, channels=6):
        super().__init__()

        def branch(k):
            return nn.Sequential(nn.Conv2d(channels, 4, k, padding=k // 2), nn.ReLU(), nn.Conv2d(4, 4, 1))

        self.a = nn.ModuleList(branch(k) for k in (1, 3, 5))
        self.pool = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), nn.Conv2d(channels, 4, 1))
        self.mix = nn.Conv2d(16, channels, 1)
        self.b = nn.ModuleList(branch(k) for k in (1, 3))
        self.head = nn.Linear(8 * 8 * 8, 3)

    def forward(self, x):
        x = torch.relu(self.mix(torch.cat([*(b(x) for b in self.a), self.pool(x)], dim=1)))
        x = torch.cat([b(x) for b in self.b], dim=1)
        return self.head(x.flatten(1))


class DictInTupleOut(nn.Module):
    """Keyword inputs (a dict batch), a non-tensor argument, and a tuple output."""

    def __init__(self):
        super().__init__()
        self.image = nn.Linear(10, 16)
        self.side = nn.Linear(3, 16)
        self.joint = nn.Linear(16, 16)
        self.cls = nn.Linear(16, 4)
        self.reg = nn.Linear(16, 2)

    def forward(self, image, meta, scale: float = 1.0):
        h = torch.relu(self.image(image)) + torch.sigmoid(self.side(meta)) * scale
        h = torch.relu(self.joint(h))
        return self.cls(h), (self.reg(h), h)


FAIL = {"forward": False, "backward": False, "interrupt": False}


def fuse(x):
    """An op whose forward or backward raises when FAIL says so (fx keeps it as one call)."""
    return _Fuse.apply(x)


torch.fx.wrap("fuse")


class _Fuse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if FAIL["forward"]:
            raise RuntimeError("forward fuse blew")
        if FAIL["interrupt"]:
            import signal
            import threading
            import time

            # as if the user pressed Ctrl-C while the stage works: a real signal wakes the main
            # thread wherever it waits (``_thread.interrupt_main`` only flags it for later)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.2)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if FAIL["backward"]:
            raise ValueError("backward fuse blew")
        return grad


class Explosive(nn.Module):
    """Raises in forward or in backward on demand, to test failure handling."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = self.b(h)
        h = fuse(self.c(h))
        return self.d(h)


class TiedEmbedding(nn.Module):
    """A shared embedding and output layer: the same parameter is used by the first and last stage."""

    def __init__(self, vocab=40, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))
