"""Helpers for lab tests that deploy clusters: a derived inventory per test cluster (own
state dir, optional profile and changes), the CLI as a user runs it, and a clean slate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from pdops.inventory import single_file_doc

REPO = Path(__file__).resolve().parents[2]


def derived_inventory(lab, where: Path, *, mutate=None, profile: dict | None = None) -> Path:
    """A copy of the lab's inventory with its own state dir (and an optional change).
    `profile` updates the lab-sim profile (e.g. {"env": {"PDOPS_SIM_DECODE_STEP_MS": "50"}})."""
    doc = single_file_doc(Path(lab.inventory))
    where.mkdir(parents=True, exist_ok=True)
    doc["all"]["vars"]["pdops_state_dir"] = str(where / "state")
    if profile is not None:
        base = yaml.safe_load((REPO / "pdops" / "profiles" / "lab-sim.yml").read_text())
        base.update(profile)
        (where / "profiles").mkdir(exist_ok=True)
        (where / "profiles" / "p.yml").write_text(yaml.safe_dump(base))
        doc["all"]["vars"]["pdops_profile"] = "profiles/p.yml"
    if mutate:
        mutate(doc)
    (where / "hosts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return where


def inv_cmd(*args, timeout=600) -> subprocess.CompletedProcess:
    """Run `inv <args>` from the repository, as an operator would."""
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def stop_all(lab) -> None:
    """A clean slate between test clusters: stop every pdops unit on every lab host, by unit name."""
    for name, _ in lab.hosts:
        c = lab.connection(name)
        units = c.run("systemctl list-units --all --plain --no-legend 'pdops-*' | awk '{print $1}'",
                      hide=True, warn=True).stdout.split()
        if units:
            c.run("systemctl stop " + " ".join(units) + " ; systemctl reset-failed " + " ".join(units),
                  hide=True, warn=True)
        c.close()
