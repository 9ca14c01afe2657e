"""The Accelerate names zerofit answers to: scripts change only their imports, so each name must exist and
behave as Accelerate documents (or say clearly what zerofit does instead)."""

from __future__ import annotations

from zerofit import DistributedType


def test_distributed_type_has_accelerates_members_and_aliases():
    for name in ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM"):
        assert getattr(DistributedType, name).value == name
    assert DistributedType.TPU is DistributedType.XLA  # Accelerate's deprecated spelling
    assert DistributedType.ZERO is DistributedType.DEEPSPEED  # zerofit's older name
    assert DistributedType("DEEPSPEED") == "DEEPSPEED"
