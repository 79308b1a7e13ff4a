"""The ServerApp: fedsub's submodel strategy, settings from the run config."""

from fedsub.flower.apps import make_server_app

app = make_server_app()
