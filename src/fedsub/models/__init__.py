"""Models as pure functions of ``Params`` and a ``Batch``: the engine never needs to know which."""

from fedsub.models.base import Batch, Model, forward
from fedsub.models.registry import build_model, model_names

__all__ = ["Batch", "Model", "build_model", "forward", "model_names"]
