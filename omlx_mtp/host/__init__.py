"""Glue for hosts: the only place that knows a host's internals (called from patched call sites)."""
