"""Engines on other machines: engine replicas on Ray Serve behind the same pool contract as the local pool."""
