"""What a node is: its capabilities, announced in its signed status, and what a job may require of them.

An agent probes its machine once at start (:func:`probe`): cores, memory, accelerator, the trainer
backends it can run, the fedtier and wire-protocol versions. The record travels in the node's status
(signed like the rest of it), so the fleet view and the cells read it without asking the node. A job's
``[requirements]`` (:class:`protocols.config.RequirementsSection`) are checked against it by
:func:`unmet`: a cell plans only the devices that meet them, and says why the others were left out.

Capabilities are declared by the node, not inferred from its name; a device that lies about them gains
nothing but tasks it then fails (counted), so they are a planning aid, not a security boundary.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from collections.abc import Mapping
from functools import cache
from typing import Any

WIRE_VERSION = 1
"""The wire protocol this build speaks (the envelope ``FTW1``, its signatures and topics)."""


def _memory_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024))
    except (AttributeError, OSError, ValueError):
        return 0


GPU_DRIVER_FILES = ("nvidia", "kfd", "dxg")
"""Where a Linux GPU torch could use shows in ``/dev``: NVIDIA's ``nvidiactl``/``nvidia0``..., ROCm's ``kfd``,
WSL's ``dxg``."""


def _no_gpu_driver() -> bool:
    """Whether this machine surely has no GPU for torch: a Linux whose ``/dev`` has no GPU driver's file."""
    if sys.platform != "linux":
        return False
    try:
        return not any(name.startswith(GPU_DRIVER_FILES) for name in os.listdir("/dev"))
    except OSError:
        return False


NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
"""The NVIDIA driver's folder of one ``information`` file a GPU (``Model: NVIDIA H200``)."""


def _cuda() -> tuple[bool, str]:
    """``(available, name)``, without importing torch where torch is not installed or no GPU driver is: a cell or
    cloud that never trains then starts without torch (about 1.5 s and 300 MB a process). Never creates a CUDA
    context (:func:`gpu_name`)."""
    if importlib.util.find_spec("torch") is None or _no_gpu_driver():
        return False, ""
    import torch

    if not torch.cuda.is_available():
        return False, ""
    return True, gpu_name()


def gpu_name(folder: str | None = None) -> str:
    """The first GPU's model name as the NVIDIA driver's files say it, else torch's where this process has already
    set CUDA up, else ``""``. Asking torch otherwise (``torch.cuda.get_device_name``) sets CUDA up in the process: a
    CUDA context on the GPU (hundreds of MB of its memory, ~1 s) in every agent, cell and sim worker of a GPU machine
    that announced its capabilities, also for a job on the CPU (seen on an H200: a ``device = "cpu"`` run had
    initialised CUDA)."""
    folder = NVIDIA_GPUS if folder is None else folder
    try:
        folders = sorted(os.listdir(folder))
    except OSError:
        folders = []
    for name in folders:
        try:
            with open(os.path.join(folder, name, "information"), encoding="utf-8", errors="replace") as f:
                text = f.read(64 << 10)
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model" and value.strip():
                return value.strip()[:128]
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_initialized() else ""


def probe(backends: tuple[str, ...] | None = None) -> dict[str, Any]:
    """This machine's capabilities, as the small JSON-able record a status carries."""
    has_cuda, gpu = _cuda()
    if backends is None:
        backends = tuple(b for b, mod in (("torch", "torch"), ("onnx", "onnxruntime")) if importlib.util.find_spec(mod))
    caps: dict[str, Any] = {
        "cores": os.cpu_count() or 1,
        "memory_mb": _memory_mb(),
        "accelerator": "cuda" if has_cuda else "none",
        "backends": sorted(backends),
        "fedtier": _version(),
        "wire": WIRE_VERSION,
        "python": platform.python_version(),
    }
    if gpu:
        caps["gpu"] = gpu
    return caps


@cache
def machine_caps() -> dict[str, Any]:
    """This machine's capabilities (probed once a process), announced by every node it runs."""
    return probe()


def unmet(caps: Mapping[str, Any] | None, requirements: Any) -> str | None:
    """Why a node with ``caps`` cannot serve a job with ``requirements`` (a ``RequirementsSection``), or
    ``None`` if it can. A node that announced no capabilities meets only a job that requires nothing."""
    r = requirements
    if caps is None:
        return None if r.nothing_required() else "announced no capabilities"
    if _int(caps.get("wire"), WIRE_VERSION) != r.wire:
        return f"speaks wire protocol {caps.get('wire')!r}, the job needs {r.wire}"
    if _int(caps.get("cores"), 0) < r.min_cores:
        return f"{caps.get('cores')} cores < min_cores {r.min_cores}"
    if _int(caps.get("memory_mb"), 0) < r.min_memory_mb:
        return f"{caps.get('memory_mb')} MB memory < min_memory_mb {r.min_memory_mb}"
    if r.accelerator != "any" and caps.get("accelerator") != r.accelerator:
        return f"accelerator {caps.get('accelerator')!r}, the job needs {r.accelerator!r}"
    backends = caps.get("backends")
    if r.backend != "any" and not (isinstance(backends, list) and r.backend in backends):
        return f"backends {backends!r} lack {r.backend!r}"
    return None


def _version() -> str:
    try:
        return importlib.metadata.version("fedtier")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
