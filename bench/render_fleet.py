"""Benchmark: render the reference fleet (16 x 8 RTX 6000D) at 12P4D, 128 GPUs.

Goal (issue: foundation): under 1 second. Prints the median of several runs of
load + place + render + write (build folder and manifest).
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdops.model.build import load_and_place  # noqa: E402
from pdops.model.render import render_files, write_build  # noqa: E402


def once(out: Path) -> float:
    t0 = time.perf_counter()
    inv, pl = load_and_place(REPO / "inventory" / "rtx6000d", "12p4d")
    write_build(render_files(inv, pl), out)
    return time.perf_counter() - t0


def main(runs: int = 9) -> None:
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        times = [once(Path(d) / "b") for _ in range(runs)]
    med = statistics.median(times)
    print(f"render 12p4d on rtx6000d (128 GPUs, {runs} runs): median {med * 1000:.1f} ms, "
          f"min {min(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms; goal < 1000 ms: "
          f"{'met' if med < 1 else 'NOT met'} ({med / 1.0:.3f} of the goal)")


if __name__ == "__main__":
    main()
