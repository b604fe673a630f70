"""pdops.sim: a stand-in SGLang 0.5.23 engine for machines without GPUs.

Started exactly like ``python -m sglang.launch_server`` (same flags), it serves SGLang's
HTTP surface and PD bootstrap protocol with a configurable timing model. See docs/sim.md.
The SGLang version whose surface it reproduces: pdops.model.versions.SIM_VERSION.
"""
