"""Algorithms as choices of the round's stages (aggregation, server optimizer), not subclasses."""

from fedsub.algorithms.registry import Algorithm, algorithm_names, build_algorithm

__all__ = ["Algorithm", "algorithm_names", "build_algorithm"]
