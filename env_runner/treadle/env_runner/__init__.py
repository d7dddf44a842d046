"""Treadle env runner: executes environments (task set × harness × runtime) and
publishes rollouts with per-token provenance.

Today: the service shell (config, control plane, lifecycle). The environment library,
sandbox and interception server land with the environments issue. This package never
imports torch or vLLM.
"""
