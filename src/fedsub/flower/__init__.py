"""fedsub on Flower (flwr 1.4x Message API): each node gets only its submodel.

- ``settings``: the run's settings (fedsub config + Flower-side knobs) from a run config.
- ``records``: submodels and row deltas as Flower ``ArrayRecord``s.
- ``joining``: who is in the federation (nodes register as they come online).
- ``checkpoints``: which run an out-dir holds, and the checkpoint a resume continues.
- ``server_runtime``: Flower as a runtime of the engine's round loop: it learns the nodes'
  index sets as they register, sends every sampled node one Message with its rows and the
  dense parameters (``train_round``), and reads the row deltas back for the loop's server
  round (fedsub's aggregators and server optimizers).
- ``apps``: the ``ServerApp`` and ``ClientApp`` factories used by ``examples/flower-fedsubavg``.

Flower is an optional extra: ``pip install fedsub[flower]``.
"""
