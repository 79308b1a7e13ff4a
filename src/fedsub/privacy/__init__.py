"""Heat counts without revealing any client's submodel: secure aggregation, sketches and
randomized response."""
