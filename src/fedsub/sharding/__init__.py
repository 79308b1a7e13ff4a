"""Row-sharded server tables under torchrun (``execution.table_sharding = "rows"``).

Each of the P processes owns a contiguous 1/P of every table's rows (``partition.py``), with
their server-optimizer state and heat coefficients; a round fetches the cohort's rows from
their owners and routes the row deltas back to them (``exchange.py``, ``rounds.py``), the
evaluation fetches the rows the evaluation sets read (``evaluation.py``), and the final model is
written as one safetensors file, each process writing its own rows (``model_file.py``).
"""
