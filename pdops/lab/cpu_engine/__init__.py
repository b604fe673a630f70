"""Real SGLang on the lab's CPU (issue 50): what the lab adds so that SGLang 0.5.23 runs without a
GPU. `standins/` holds import stand-ins for GPU-only packages and a start-up patch; the lab's CPU
profile (pdops/profiles/lab-sglang-cpu.yml) puts that folder on the engine's PYTHONPATH. Nothing here
is rendered for a GPU host: a profile that names no `cpu` device never sees it."""

from pathlib import Path

STANDINS = Path(__file__).resolve().parent / "standins"
