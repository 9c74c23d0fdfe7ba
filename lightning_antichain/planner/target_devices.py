"""The GPUs a plan may be made for without one at hand: their published peaks, memory and links.

``plan --gpu H100-SXM`` plans for that GPU from this table: each captured operation is costed on
its roofline (:mod:`.roofline`), the collectives on its links. The figures are the vendors'
published dense peaks (no 2:4 sparsity), per GPU; a GPU not listed is described in a small JSON
file with the same fields (:func:`target_device`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class TargetDevice:
    """One GPU as the planner sees it: dense peak TFLOPS by dtype, memory bandwidth and size,
    and the links each GPU has to the others of its node and to other nodes (each direction)."""

    name: str
    memory_gb: float
    hbm_gbps: float
    bf16_tflops: float
    fp32_tflops: float
    #: float32 matrix products on tensor cores (TF32), as torch runs them with
    #: ``torch.backends.cuda.matmul.allow_tf32``; ``None``: none (float32 matmuls at ``fp32_tflops``)
    tf32_tflops: float | None
    #: one GPU's bandwidth to the GPUs of its node, one direction (NVLink, Infinity Fabric, PCIe)
    intranode_gbps: float
    #: one GPU's network adapter to other nodes in Gb/s (bits: as adapters are sold)
    internode_gbit: float
    source: str

    def peak_flops(self, dtype: torch.dtype, matmul: bool) -> float:
        """FLOP/s at the dense peak for an operation in ``dtype``: tensor cores for the matrix
        products of 16-bit (and, where the GPU has TF32, 32-bit) types, the vector units else."""
        if dtype in (torch.bfloat16, torch.float16):
            return (self.bf16_tflops if matmul else 2 * self.fp32_tflops) * 1e12
        if matmul and dtype == torch.float32 and self.tf32_tflops:
            return self.tf32_tflops * 1e12
        if dtype == torch.float64:
            return self.fp32_tflops / 2 * 1e12
        return self.fp32_tflops * 1e12

    @property
    def internode_gbps(self) -> float:
        """The network adapter's bandwidth in GB/s."""
        return self.internode_gbit / 8


_DATASHEETS = {
    "A100": "NVIDIA A100 Tensor Core GPU datasheet (2021): SXM4, dense",
    "H100": "NVIDIA H100 Tensor Core GPU datasheet (2023): dense (half the sparse figures)",
    "H200": "NVIDIA H200 Tensor Core GPU product page (2024): dense",
    "B200": "NVIDIA HGX B200 specifications (2024), per GPU: dense",
    "MI300X": "AMD Instinct MI300X datasheet (2023): dense, peak engine clock",
}

#: the GPUs known by name; NVLink figures are one direction (half the bidirectional total), the
#: network one adapter a GPU as in the vendors' reference nodes (DGX, HGX, MI300X platform)
TARGET_DEVICES: dict[str, TargetDevice] = {d.name: d for d in (
    TargetDevice("A100-40GB", 40, 1555, 312, 19.5, 156, 300, 200, _DATASHEETS["A100"]),
    TargetDevice("A100-80GB", 80, 2039, 312, 19.5, 156, 300, 200, _DATASHEETS["A100"]),
    TargetDevice("H100-SXM", 80, 3350, 989, 67, 494.5, 450, 400, _DATASHEETS["H100"]),
    TargetDevice("H100-PCIe", 80, 2000, 756, 51, 378, 64, 400, _DATASHEETS["H100"] + "; PCIe Gen5 x16"),
    TargetDevice("H200", 141, 4800, 989, 67, 494.5, 450, 400, _DATASHEETS["H200"]),
    TargetDevice("B200", 180, 8000, 2250, 75, 1100, 900, 400, _DATASHEETS["B200"]),
    TargetDevice("MI300X", 192, 5300, 1307.4, 163.4, 653.7, 448, 400, _DATASHEETS["MI300X"]),
)}

_ALIASES = {"A100": "A100-80GB", "H100": "H100-SXM"}


def target_device(name: str) -> TargetDevice:
    """The GPU called ``name`` (case aside; ``H100`` is the SXM part, ``A100`` the 80 GB), or the
    one a JSON file at ``name`` describes with :class:`TargetDevice`'s fields."""
    path = Path(name).expanduser()
    if path.suffix == ".json":
        return _from_file(path)
    known = {k.lower(): k for k in TARGET_DEVICES} | {k.lower(): v for k, v in _ALIASES.items()}
    found = known.get(name.lower())
    if found is None:
        raise ValueError(f"--gpu {name}: not a GPU this planner knows ({', '.join(TARGET_DEVICES)}); describe it "
                         f"in a JSON file of {', '.join(f.name for f in dataclasses.fields(TargetDevice))} and give "
                         "its path")
    return TARGET_DEVICES[found]


def _from_file(path: Path) -> TargetDevice:
    if not path.is_file():
        raise ValueError(f"--gpu {path}: there is no such file")
    try:
        fields: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--gpu {path}: not JSON ({exc})") from None
    names = [f.name for f in dataclasses.fields(TargetDevice)]
    fields.setdefault("name", path.stem)
    fields.setdefault("source", str(path))
    fields.setdefault("tf32_tflops", None)
    missing = [n for n in names if n not in fields]
    unknown = [n for n in fields if n not in names]
    if missing or unknown:
        raise ValueError(f"--gpu {path}: " + "; ".join(
            part for part in (f"missing {', '.join(missing)}" if missing else "",
                              f"unknown {', '.join(unknown)}" if unknown else "") if part)
            + f" (the fields: {', '.join(names)})")
    numbers = [n for n in names if n not in ("name", "source", "tf32_tflops")]
    bad = [n for n in numbers if not isinstance(fields[n], (int, float)) or not fields[n] > 0]
    if bad:
        raise ValueError(f"--gpu {path}: {', '.join(bad)} must be numbers above 0")
    return TargetDevice(**fields)
