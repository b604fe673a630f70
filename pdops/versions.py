"""Pinned versions of the engine and gateway pdops renders for. Re-check SGLANG.md when moving a pin."""

SGLANG_VERSION = "0.5.23"
SGLANG_ROUTER_VERSION = "0.3.2"
TORCH_CPU_VERSION = "2.13.0"
MOONCAKE_VERSION = "0.3.7"
