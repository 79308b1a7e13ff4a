"""The ClientApp: each node trains its submodel on its own data (its data-file read with the
run's feature spec, or its partition of a fedsub dataset) and evaluates on its held-out part."""

from fedsub.flower.apps import make_client_app

app = make_client_app()
