"""Client work: what a client does with its pulled submodel in a round (the local rule, per
member inputs such as lr scales and SCAFFOLD's corrections), shared by every backend."""
