"""Launching: local processes, Ray actors, cluster config (built in a later issue)."""
