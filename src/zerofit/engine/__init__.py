"""The ZeRO runtime: communication units, stage policies, collectives, the sharded optimizer step."""

from zerofit.engine.engine import ZeroEngine

__all__ = ["ZeroEngine"]
