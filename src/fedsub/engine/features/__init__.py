"""The round's features as adapters (engine/contribution.py): each module here is one feature's
``Feature``, the only place outside its package that wires it into a round; ``assembly.py``
asks them in one explicit order (``FEATURES``) and builds the server round and the client work.
"""
