"""fedsub on Flower (flwr 1.41, Message API): Flower as the transport of fedsub's own round
loop, each node sent only its submodel; ``apps`` has the ``ServerApp`` and ``ClientApp``
factories that ``examples/flower-fedsubavg`` uses. The user's page is docs/tutorials/flower.md;
what each module does, docs/develop/architecture.md ("The Flower runtime").

Flower is an optional extra: ``pip install fedsub[flower]``.
"""
