"""Helpers the unit tests share (not a test module): an instance's observation built as
pdops.reads.observe makes it, and its state word as `inv status` judges it."""

from __future__ import annotations

from pdops.facts.gateway import Worker
from pdops.facts.systemd import parse_by_id
from pdops.reads.observation import InstanceObservation
from pdops.reads.status import judge


def unit(active="active", sub="running", pid=100, restarts=0):
    text = (f"Id=u\nLoadState=loaded\nActiveState={active}\nSubState={sub}\nMainPID={pid if active == 'active' else 0}\n"
            f"NRestarts={restarts}\nResult=success\nUnitFileState=enabled\n\n")
    return parse_by_id(text)["u"]


def obs(inst, *, state=None, recorded=100, worker="ready", healthy=True, in_list=True, running=None, expected=None):
    key = f"{inst.head.host}:{inst.units[0][1]}"
    w = None if worker is None else Worker(id="w1", url=inst.url, model_id="m", worker_type=inst.role,
                                           status=worker, is_healthy=healthy, load=0)
    return InstanceObservation(inst, {key: state or unit()}, {key: recorded} if recorded else {}, {"lab01": w},
                               {"lab01": in_list}, running=running or {}, expected=expected or {})


def word(o, **kw):
    args = {"gateway_down": False, "loads_error": None, "failures": {}, "strays": []}
    args.update(kw)
    return judge(o, **args)
