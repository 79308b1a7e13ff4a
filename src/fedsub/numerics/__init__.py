"""Numerical ground rules every layer shares: keyed random streams (seeding), finiteness
checks, and deterministic segment sums (the round's scatter-adds without atomics)."""
