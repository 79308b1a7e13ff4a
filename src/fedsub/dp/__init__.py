"""User-level differential privacy for federated (submodel) training, as small pure pieces.

- ``settings``: the resolved ``[dp]`` settings of a run (noise multiplier calibrated, delta
  resolved, the noise split between row selection and the update);
- ``accountant``: the round's ``dp_accounting`` event and the epsilon of a number of rounds
  (Google's dp-accounting, RDP or PLD; no formula is written here);
- ``clipping``: each member's whole update clipped to L2 norm C;
- ``selection``: sparsity-preserving row selection (DP-AdaFEST's thresholded noisy contribution
  histogram, false positives sampled without touching every row);
- ``mechanism``: one round's Gaussian mechanism, clipped sum -> noise -> fixed denominator ->
  (FedSubAvg) private heat coefficients;
- ``ledger``: the rounds composed so far, a checkpoint stage.

A runtime calls ``DpMechanism.combine`` where it would aggregate the cohort's updates and
``Ledger`` around it (engine/server_round.py does, once).
"""
