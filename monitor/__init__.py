"""Monitoring of simulated and deployed runs: record sources, the live view, the HTML report, and the
Prometheus exporter. Reads the telemetry records of ``protocols.records``; imports nothing from the
runtimes or the simulation."""
