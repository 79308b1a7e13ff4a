"""fedsub: federated submodel training (FedSubAvg and friends) for sparse models."""

from fedsub.errors import ConfigError, DataError, FedsubError

__all__ = ["ConfigError", "DataError", "FedsubError"]
__version__ = "0.1.0"
