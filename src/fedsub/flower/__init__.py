"""fedsub on Flower (flwr 1.4x Message API): each node gets only its submodel.

- ``settings``: the run's settings (fedsub config + Flower-side knobs) from a run config.
- ``records``: submodels and row deltas as Flower ``ArrayRecord``s.
- ``membership``: who is in the federation (nodes register as they come online).
- ``checkpoints``: the ServerApp's checkpoints and resume.
- ``strategy``: a ``flwr.serverapp.strategy.Strategy`` that learns the nodes' index sets as
  they register, sends every sampled node one Message with its rows and the dense parameters,
  and aggregates the row deltas with fedsub's aggregators and server optimizers.
- ``apps``: the ``ServerApp`` and ``ClientApp`` factories used by ``examples/flower-fedsubavg``.

Flower is an optional extra: ``pip install fedsub[flower]``.
"""
