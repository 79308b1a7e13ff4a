"""The ServerApp: fedsub's round loop with Flower as its runtime, settings from the run
config."""

from fedsub.flower.apps import make_server_app

app = make_server_app()
