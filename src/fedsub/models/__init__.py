"""Models as pure functions of ``Params`` and a ``Batch``: the engine never needs to know which."""

from fedsub.models.base import Batch, Model
from fedsub.models.registry import build_model, model_names

__all__ = ["Batch", "Model", "build_model", "model_names"]
