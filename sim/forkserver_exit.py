"""Imported by the sim's fork server only, first of :data:`sim.worker_context.PRELOAD`: the server exits without the
interpreter's final collections over the heap torch and the workers' modules left it (``protocols.fast_exit``).

The server exits once its last worker has (its alive pipe closed), after its launcher: with torch imported its
interpreter took 1.3-2.3 s to exit (load ~6.5, 2 cores; 0.3 s with this), the last process of a run to go, and a
SIGKILLed run's was once still alive 10 s after its workers had gone (test_orphans, a fresh-clone suite at load ~9).
Its forked workers exit with ``os._exit`` and run no exit handler: this changes nothing for them."""

from __future__ import annotations

from protocols.fast_exit import skip_exit_collection

skip_exit_collection()
