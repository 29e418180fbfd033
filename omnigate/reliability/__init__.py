"""Reliability tooling that runs against a live server: abort and disconnect storms, resource footprints, soaks."""
