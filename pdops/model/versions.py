"""Pinned versions of the engine and gateway pdops renders for. Re-check docs/design/sglang.md when moving a pin."""

SGLANG_VERSION = "0.5.23"
# the SGLang version whose surface pdops.sim reproduces (a bench records it): moved by hand, once the
# sim is checked against the new pin (docs/sim.md), not with SGLANG_VERSION
SIM_VERSION = "0.5.23"
# The model gateway: `smg` (Shepherd Model Gateway), the maintained successor of sglang-router
# (0.3.2 was the last release under that name). It runs from its own environment on the
# gateway host (pdops_gateway.python), which holds no torch and no SGLang.
SMG_VERSION = "1.13.0"
TORCH_CPU_VERSION = "2.13.0"
MOONCAKE_VERSION = "0.3.13.post1"
