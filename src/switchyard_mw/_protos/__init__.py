"""Envoy's ext_proc protos, generated: do not edit; `scripts/regen_envoy_protos.py` rewrites
this folder (it says why they are vendored)."""
