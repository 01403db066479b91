"""Datasets, samplers and transforms (no training logic)."""
