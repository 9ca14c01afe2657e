"""zerofit: ZeRO sharding and offload for PyTorch training, driven by the config files you already have."""

__version__ = "0.1.0"
