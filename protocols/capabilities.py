"""What a node is: its capabilities, announced in its signed status, and what a job may require of them.

An agent probes its machine once at start (:func:`probe`): cores, memory, accelerator, the trainer
backends it can run, the fedtier and wire-protocol versions. The probe imports torch (1-3 s), so a node
runs it on a thread of its own (:func:`start_probe`) and says idle meanwhile, without capabilities;
whatever plans by them waits for them (:func:`machine_caps`). The record travels in the node's status
(signed like the rest of it), so the fleet view and the cells read it without asking the node. A job's
``[requirements]`` (:class:`protocols.config.RequirementsSection`) are checked against it by
:func:`unmet`: a cell plans only the devices that meet them, and says why the others were left out.

Capabilities are declared by the node, not inferred from its name; a device that lies about them gains
nothing but tasks it then fails (counted), so they are a planning aid, not a security boundary.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import platform
import threading
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("fedtier.capabilities")
WIRE_VERSION = 1
"""The wire protocol this build speaks (the envelope ``FTW1``, its signatures and topics)."""


def _memory_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024))
    except (AttributeError, OSError, ValueError):
        return 0


def _cuda() -> tuple[bool, str]:
    """``(available, name)``, without importing torch where torch is not installed."""
    if importlib.util.find_spec("torch") is None:
        return False, ""
    import torch

    if not torch.cuda.is_available():
        return False, ""
    return True, torch.cuda.get_device_name(0)


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


class _MachineProbe:
    """This process's one :func:`probe`, run on a thread of its own (it imports torch, 1-3 s) so that a node
    can connect and say it is idle meanwhile; whoever needs the record waits for it (:meth:`get`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._caps: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._waiting: list[Callable[[dict[str, Any]], None]] = []

    def start(self) -> None:
        """Start probing, once a process (later calls do nothing)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="caps-probe", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            caps: dict[str, Any] | None = probe()
        except BaseException as exc:  # re-raised to whoever asks for the record (get)
            log.error("probing this machine's capabilities failed: %r", exc)
            caps, self._error = None, exc
        with self._lock:
            self._caps, waiting, self._waiting = caps, self._waiting, []
            self._done.set()
        if caps is not None:
            for call in waiting:
                call(caps)

    def get(self) -> dict[str, Any]:
        """The record, waiting for the probe (started now if it was not); raises what the probe raised."""
        self.start()
        self._done.wait()
        if self._caps is None:  # the probe raised: so does each caller, as when it probed on its own thread
            raise self._error or RuntimeError("probing this machine's capabilities failed")
        return self._caps

    def known(self) -> dict[str, Any] | None:
        """The record if the probe has finished (started now if it was not), else ``None``: no waiting."""
        self.start()
        return self._caps if self._done.is_set() else None

    def when_known(self, call: Callable[[dict[str, Any]], None]) -> None:
        """``call(record)`` once the probe has finished (now, on this thread, if it has; else on the probe's
        thread); never if it failed."""
        self.start()
        with self._lock:
            if not self._done.is_set():
                self._waiting.append(call)
                return
        if self._caps is not None:
            call(self._caps)


_machine = _MachineProbe()


def start_probe() -> None:
    """Start probing this machine's capabilities in the background (a node calls it first thing, so the
    record is ready, or nearly, when it first needs it)."""
    _machine.start()


def machine_caps() -> dict[str, Any]:
    """This machine's capabilities (probed once a process), announced by every node it runs; waits for the
    probe if it is still running."""
    return _machine.get()


def known_caps() -> dict[str, Any] | None:
    """This machine's capabilities if the probe has finished, else ``None`` (it is started if it was not)."""
    return _machine.known()


def when_caps_known(call: Callable[[dict[str, Any]], None]) -> None:
    """Call ``call(record)`` once this machine's capabilities are known (at once if they are), from the
    probe's thread otherwise: ``call`` must be thread-safe (e.g. post to a loop)."""
    _machine.when_known(call)


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
