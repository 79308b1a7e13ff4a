"""Sub-model training for resource-limited clients (seed 003): which slice each client trains
(``schemes``), at which capacity (``capacity``), and how the slices are averaged back
(``aggregate``)."""
