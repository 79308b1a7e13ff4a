"""The ClientApp: each node trains its partition's submodel with fedsub's client work."""

from fedsub.flower.apps import make_client_app

app = make_client_app()
