"""The sim engine's faults (pdops.sim; off by default): what PDOPS_SIM_FAULTS, POST /_sim/faults and
the lab-only inventory setting `pdops_sim_faults` may name, parsed to the settings the sim runs with.
In the model because the inventory checks `pdops_sim_faults` with it before anything runs; the sim
imports it from here (product code never imports the sim).

PDOPS_SIM_FAULTS is a comma list of ``name`` or ``name=value``:

- ``fail_transfer``      the prefill reports every KV transfer failed (500 on both sides)
- ``fail_transfer_above=TOKENS``  the prefill fails the KV transfer of every prompt longer than
  TOKENS (short canaries pass, the long requests of a probe fail: a transfer fault in its window)
- ``hang_room`` / ``hang_room=ROOM``  the prefill never sends the KV of every room / of
  that room; the decode gives 500 at SGLANG_DISAGGREGATION_WAITING_TIMEOUT, then the
  prefill too
- ``ignore_sigterm``     SIGTERM is logged and ignored (only SIGKILL stops the process)
- ``crash_child`` / ``crash_child=SECONDS``  the first scheduler child exits with status 1
  (now / after SECONDS); the main process then kills its tree and exits 1, like SGLang
- ``stray_grandchild``   a scheduler child double-forks a process (``sglang::stray``,
  no parent-death signal) that is reparented but stays in the unit's cgroup; its pid is
  in GET /_sim/state. It lives PDOPS_SIM_STRAY_SECONDS (default 3600).
- ``escape_cgroup``      the main process forks ``sglang::scheduler_escaped``, which keeps
  the parent's listening sockets (HTTP and bootstrap ports), has no parent-death signal
  and moves itself out of the unit's cgroup (into ``pdops-sim-escaped`` at the cgroup
  root, on cgroup2 and the name=systemd hierarchy): systemd's stop cannot reach it, as
  with a reparented SGLang scheduler (sglang#23627). It lives PDOPS_SIM_STRAY_SECONDS.
- ``dead_session``       on a decode: its KV transfer session is dead, as after the one transient
  transfer error of sglang#13054: every request it takes fails at the transfer ("session not
  alive", 500 on both sides, counted in num_transfer_failed_reqs_total), fast, until the process
  restarts (a fault set at run time is gone with the process)
- ``unhealthy_after=N``  /health (and /health_generate, /ready) answer 503 once they have
  answered 200 N times: 0 never turns healthy (a model that never loads); 1 passes
  pdops's health gate once and is never healthy for the gateway (an engine that wedges
  right after start-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KNOWN = ("fail_transfer", "fail_transfer_above", "hang_room", "ignore_sigterm", "crash_child", "stray_grandchild", "escape_cgroup",
         "unhealthy_after", "dead_session")


@dataclass
class Faults:
    fail_transfer: bool = False
    fail_transfer_above: int | None = None  # prompt tokens above which every transfer fails
    hang_room: bool | int = False  # True: every room; int: that room
    ignore_sigterm: bool = False
    crash_child: float | None = None  # seconds after start (or after the admin call)
    stray_grandchild: bool = False
    escape_cgroup: bool = False
    unhealthy_after: int | None = None  # healthy answers before /health turns 503 for good
    dead_session: bool = False  # decode: every transfer fails until the process restarts
    extra: dict = field(default_factory=dict)

    def hangs(self, room: int) -> bool:
        if self.hang_room is True:
            return True
        return self.hang_room is not False and int(self.hang_room) == int(room)

    def as_dict(self) -> dict:
        return {
            "fail_transfer": self.fail_transfer,
            "fail_transfer_above": self.fail_transfer_above,
            "hang_room": self.hang_room,
            "ignore_sigterm": self.ignore_sigterm,
            "crash_child": self.crash_child,
            "stray_grandchild": self.stray_grandchild,
            "escape_cgroup": self.escape_cgroup,
            "unhealthy_after": self.unhealthy_after,
            "dead_session": self.dead_session,
        }

    def update(self, values: dict) -> None:
        """Apply a JSON object of fault settings (the admin endpoint's body)."""
        for k, v in values.items():
            if k not in KNOWN:
                raise ValueError(f"unknown fault {k!r}; known: {', '.join(KNOWN)}")
            if k == "hang_room":
                self.hang_room = v if isinstance(v, bool) else int(v)
            elif k == "crash_child":
                self.crash_child = None if v is None or v is False else (0.0 if v is True else float(v))
            elif k == "fail_transfer_above":
                self.fail_transfer_above = None if v is None or v is False else int(v)
            elif k == "unhealthy_after":
                if v is None or v is False:
                    self.unhealthy_after = None
                else:
                    n = 1 if v is True else int(v)
                    if n < 0:
                        raise ValueError("unhealthy_after must be 0 or more")
                    self.unhealthy_after = n
            else:
                setattr(self, k, bool(v))


def parse_faults(spec: str | None) -> Faults:
    """Parse a PDOPS_SIM_FAULTS value; an unknown name is an error (exit at startup)."""
    f = Faults()
    values: dict = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, _, raw = item.partition("=")
        name = name.strip()
        if name not in KNOWN:
            raise ValueError(f"PDOPS_SIM_FAULTS: unknown fault {name!r}; known: {', '.join(KNOWN)}")
        if raw == "":
            values[name] = True
        elif name == "hang_room":
            values[name] = int(raw)
        elif name == "crash_child":
            values[name] = float(raw)
        elif name in ("unhealthy_after", "fail_transfer_above"):
            values[name] = int(raw)
        else:
            values[name] = raw.lower() not in ("0", "false", "no", "off")
    f.update(values)
    return f
