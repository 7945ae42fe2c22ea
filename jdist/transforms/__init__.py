"""Optax transformations for data-parallel training."""
