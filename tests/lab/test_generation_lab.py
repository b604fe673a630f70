"""A change of generation on the lab, under load through the admission layer (docs/changes.md
"Generations"). One 1p1d cluster, smg on lab03 and lab04 behind HAProxy on lab03; TP4, so that the
lab's four hosts have eight slots (two a host) and a fenced rollout has room for a new pool.

1. A fenced rollout whose new pool fails its canary leaves the old generation serving every
   request, both gateways routing to it again; the journal says what was undone.
2. The fenced rollout itself, with a core busy: no request fails, none is replayed.
3. A fenced rollout with too few free slots: the old pool shrinks first (`--allow-capacity-dip`);
   preflight checks the new pool on the slots the shrink frees only after the shrink (the front-door
   issue's fault 3: the dry run accepted it and preflight refused it on a port the shrink was about to
   free); under load, no request fails.
4. The hazard, shown honestly (last: it leaves smg's circuit breakers open on the new workers):
   the change back rolled the way a generation-blind planner rolls it (`--unfenced`: the lone
   instances surge, old and new serve side by side) fails requests whose prefill and decode are
   of different generations."""

from __future__ import annotations

import re
import threading

import pytest
import yaml

from pdops.model.inventory import load_inventory
from pdops.model.placement import Placement
from pdops.remote.gateway import Gateways
from tests.lab.clusters import (Load, REPO, api_keys_file, cli, cpu_hog, deployed, never_twice, record,
                                two_gateways_behind_haproxy)

KEY = "pdops-lab-key-F-" + "f" * 16  # the front door's API key of this module's cluster
AUTH = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.lab

GATEWAYS = ["lab03", "lab04"]


@pytest.fixture(scope="module")
def cluster(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("generation")
    two_gateways = two_gateways_behind_haproxy(GATEWAYS, 18083, api_keys_file(root / "admission.keys", KEY),
                                               fence_hold_s=2)
    base = yaml.safe_load((REPO / "pdops" / "profiles" / "lab-sim.yml").read_text())
    with deployed(lab, root / "inv", "1p1d", mutate=two_gateways,
                  profile={"env": {**base["env"], "PDOPS_SIM_DECODE_STEP_MS": "10"},
                           "parallel": {"tp": 4, "ep": 4, "pp": 1}}) as (inv_dir, _):
        yield inv_dir


def _set_page_size(inv_dir, page_size: int | None, faults: dict | None = None) -> None:
    prof = inv_dir / "profiles" / "p.yml"
    doc = yaml.safe_load(prof.read_text())
    if page_size is None:
        doc["bundle"].pop("page_size", None)
    else:
        doc["bundle"]["page_size"] = page_size
    prof.write_text(yaml.safe_dump(doc))
    hosts = inv_dir / "hosts.yml"
    inv = yaml.safe_load(hosts.read_text())
    if faults:
        inv["all"]["vars"]["pdops_sim_faults"] = faults
    else:
        inv["all"]["vars"].pop("pdops_sim_faults", None)
    hosts.write_text(yaml.safe_dump(inv, sort_keys=False))


def _live(inv_dir) -> Placement:
    return Placement.from_dict(record(inv_dir).current_revision().placement)


def _routes(inv_dir) -> dict[str, set[str]]:
    inv = load_inventory(inv_dir)
    return {h: {w.url for w in c.list_workers() if w.routable} for h, c in Gateways.of(inv, timeout=3).items()}


def test_a_fenced_rollout_whose_new_pool_fails_leaves_the_old_generation_serving(lab, cluster):
    inv_dir = cluster
    inv = load_inventory(inv_dir)
    before = _live(inv_dir)
    rev0 = record(inv_dir).current_revision().number
    _set_page_size(inv_dir, 32, faults={"p02": "fail_transfer"})
    dry = cli(inv_dir, "deploy", "--topology", "1p1d", "--dry-run")
    assert dry.returncode == 0 and "rolled fenced (blue/green)" in dry.stdout, dry.stdout + dry.stderr
    assert "added:   p02 (prefill)" in dry.stdout and "d02 (decode)" in dry.stdout, dry.stdout
    with Load(inv.admission.url, AUTH, prefix="gen-halt", requests=12, concurrency=6, max_new_tokens=40) as load:
        proc = cli(inv_dir, "deploy", "--topology", "1p1d")
    assert proc.returncode != 0 and "canary new pool" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert proc.returncode == 9 and "scale stopped: canary failed for p02 x d02" in proc.stderr, out
    assert f"current revision unchanged: {rev0}" in out, out
    assert "undone: d02 (never registered; stopped, verified), p02 (never registered; stopped, verified)" in out, out
    bad = [r.to_dict() for r in load.rows if not r.ok]
    assert load.rows and not bad, bad[:3]
    urls = {i.url for i in before.instances}
    assert _live(inv_dir) == before and _routes(inv_dir) == {h: urls for h in GATEWAYS}
    j = record(inv_dir).journal()
    op = [o for o in j.operations() if o.startswith("scale-")][-1]
    steps = {r["step"]: r["status"] for r in j.read(op)}
    assert steps.get("front-door back") == "ok" and steps.get("unfence") == "ok", steps
    # the new pool never registered: undo-decide names each for the verified stop alone
    assert steps.get("undo-decide") == "ok" and steps.get("undo-stop p02") == "ok" and steps.get("undo p02") == "noop", steps
    # runbook "A failure": the journal of the operation, then verify and status
    jr = cli(inv_dir, "journal", "--op", op)
    assert jr.returncode == 0, jr.stdout + jr.stderr
    for s in ("canary new pool", "front-door back", "undo-decide", "undo-stop p02", "unfence"):
        assert f" {s}  " in jr.stdout, (s, jr.stdout)
    never_twice(lab, inv_dir, "gen-halt")
    assert cli(inv_dir, "verify").returncode == 0
    st = cli(inv_dir, "status")
    assert st.returncode == 0 and "all ok" in st.stdout, st.stdout + st.stderr


def test_a_fenced_generation_change_under_load_fails_no_request(lab, cluster):
    """Runbook docs/runbooks/generation-change.md, its commands in order: `inv status` (the
    prerequisites: two gateways ok, no warning), `inv deploy --dry-run` (the generation line, `rolled
    fenced`, the steps), `inv deploy` under load with a core busy while `inv status` is read over and
    over (what on-call sees during the rollout), then `inv journal --op` (the shifts and their hold),
    `inv verify`, `inv status`, and `inv rollback --dry-run` (refused across generations)."""
    inv_dir = cluster
    inv = load_inventory(inv_dir)
    st = cli(inv_dir, "status")
    assert st.returncode == 0 and "all ok" in st.stdout and "warning:" not in st.stdout, st.stdout + st.stderr
    for h in GATEWAYS:
        assert f"on {h}: active/running" in st.stdout, st.stdout
    rev0 = record(inv_dir).current_revision().number
    _set_page_size(inv_dir, 32)
    dry = cli(inv_dir, "deploy", "--topology", "1p1d", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert re.search(r"generation: [0-9a-f]{12} -> [0-9a-f]{12} \(page size unset -> 32\): a prefill of one and a "
                     r"decode of the other cannot exchange KV", dry.stdout), dry.stdout
    assert "rolled fenced (blue/green): the generation changes (page size unset -> 32)" in dry.stdout, dry.stdout
    for s in ("fence", "shift 10%", "shift 50%", "shift 100%", "commit", "join register p02", "front-door open"):
        assert f" {s} — " in dry.stdout, (s, dry.stdout)
    assert "only if not committed" in dry.stdout, dry.stdout
    seen: list = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            p = cli(inv_dir, "status")
            seen.append((p.returncode, p.stdout + p.stderr))
    watcher = threading.Thread(target=watch, daemon=True)
    with cpu_hog(), Load(inv.admission.url, AUTH, prefix="gen-fenced", requests=12, concurrency=6, max_new_tokens=40) as load:
        watcher.start()
        try:
            proc = cli(inv_dir, "deploy", "--topology", "1p1d")
        finally:
            done.set()
            watcher.join(timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for s in ("fence", "shift 10%", "shift 50%", "shift 100%", "commit", "front-door open"):
        assert f" {s} — " in proc.stdout, (s, proc.stdout)
    failed = [r.to_dict() for r in load.rows if not r.ok]
    print(f"\nfenced generation change under load, one core busy: {len(load.rows)} requests, {len(failed)} failed")
    assert len(load.rows) >= 12 and not failed, failed[:3]
    never_twice(lab, inv_dir, "gen-fenced")
    print(f"`inv status` read {len(seen)} time(s) during the rollout; exit statuses {[rc for rc, _ in seen]}")
    assert seen and all(rc in (0, 1) for rc, _ in seen), seen
    during = [out for rc, out in seen if rc == 1]
    assert during and all(out.startswith("lock: held by") and "running 'scale'" in out for out in during), during
    assert any("gateway lab04 degraded: " in out and "does not route to p01, d01" in out for out in during), during
    live = _live(inv_dir)
    urls = {i.url for i in live.instances}
    assert _routes(inv_dir) == {h: urls for h in GATEWAYS}
    j = record(inv_dir).journal()
    op = [o for o in j.operations() if o.startswith("scale-")][-1]
    ops = cli(inv_dir, "journal")
    assert ops.returncode == 0 and op in ops.stdout, ops.stdout + ops.stderr
    jr = cli(inv_dir, "journal", "--op", op)
    assert jr.returncode == 0, jr.stdout + jr.stderr
    for s in ("fence", "shift 10%", "shift 50%", "shift 100%", "commit", "front-door open"):
        assert f" {s}  " in jr.stdout, (s, jr.stdout)
    assert cli(inv_dir, "verify").returncode == 0
    st = cli(inv_dir, "status")
    assert st.returncode == 0 and "all ok" in st.stdout, st.stdout + st.stderr
    proc = cli(inv_dir, "deploy", "--topology", "1p1d", "--dry-run")
    assert "no change" in proc.stdout or "generation: unchanged" in proc.stdout, proc.stdout
    # the way back is not a rollback: it would replace in place and pair the generations
    rb = cli(inv_dir, "rollback", "--dry-run")
    print(f"\n$ inv rollback --dry-run: exit {rb.returncode}\n{rb.stdout}{rb.stderr}")
    assert rb.returncode == 4, rb.stdout + rb.stderr
    assert f"returning to revision {rev0} changes the generation (page size 32 -> unset)" in rb.stderr, rb.stderr
    assert "deploy the old settings instead" in rb.stderr, rb.stderr


def test_a_fenced_rollout_with_too_few_free_slots_shrinks_the_old_pool_first_and_fails_no_request(lab, cluster):
    """3p2d on eight slots leaves three free for a new pool of five: the dry run without
    `--allow-capacity-dip` is refused naming the shrink; with it, the old pool shrinks by two prefills
    (drained, verified stopped) before the fence, the new pool starts on the slots they freed, and
    preflight, run before anything changed, did not check those two against ports the shrink had yet
    to free. Under load through the front door: no request fails, none is replayed. Then back to 1p1d
    (same generation, rolled) for the last test."""
    inv_dir = cluster
    inv = load_inventory(inv_dir)
    up = cli(inv_dir, "scale", "--topology", "3p2d")
    assert up.returncode == 0, up.stdout + up.stderr
    _set_page_size(inv_dir, 16)
    refused = cli(inv_dir, "deploy", "--topology", "3p2d", "--dry-run")
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert "needs 5 free slots; there are 3: the old pool would shrink by" in refused.stderr, refused.stderr
    assert "--allow-capacity-dip" in refused.stderr, refused.stderr
    dry = cli(inv_dir, "deploy", "--topology", "3p2d", "--allow-capacity-dip", "--dry-run")
    assert dry.returncode == 0 and "rolled fenced (blue/green)" in dry.stdout, dry.stdout + dry.stderr
    shrunk = re.search(r"the old pool shrinks by ([\w, ]+) first: 3 free slot\(s\) for a new pool of 5", dry.stdout)
    assert shrunk, dry.stdout
    with Load(inv.admission.url, AUTH, prefix="gen-dip", requests=12, concurrency=6, max_new_tokens=40) as load:
        proc = cli(inv_dir, "deploy", "--topology", "3p2d", "--allow-capacity-dip")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    failed = [r.to_dict() for r in load.rows if not r.ok]
    print(f"\nfenced change with a capacity dip (the old pool shrunk by {shrunk.group(1)}) under load: "
          f"{len(load.rows)} requests, {len(failed)} failed")
    assert len(load.rows) >= 12 and not failed, failed[:3]
    never_twice(lab, inv_dir, "gen-dip")
    j = record(inv_dir).journal()
    steps = [r["step"] for r in j.read([o for o in j.operations() if o.startswith("scale-")][-1])]
    for x in shrunk.group(1).split(", "):
        assert steps.index(f"shrink {x}: verify-stop") < steps.index("fence"), steps
    assert steps.index("preflight") < steps.index(f"shrink {shrunk.group(1).split(', ')[0]}: verify-stop"), steps
    live = _live(inv_dir)
    assert len(live.role("prefill")) == 3 and len(live.role("decode")) == 2
    assert cli(inv_dir, "verify").returncode == 0
    down = cli(inv_dir, "scale", "--topology", "1p1d")
    assert down.returncode == 0, down.stdout + down.stderr


def test_a_generation_change_rolled_in_waves_fails_requests_that_pair_across(lab, cluster):
    inv_dir = cluster
    inv = load_inventory(inv_dir)
    _set_page_size(inv_dir, None)
    dry = cli(inv_dir, "deploy", "--topology", "1p1d", "--dry-run")  # the planner would fence it
    assert dry.returncode == 0 and "(page size 16 -> unset): a prefill of one and a decode of the other cannot" \
        in dry.stdout and "rolled fenced (blue/green)" in dry.stdout, dry.stdout + dry.stderr
    with Load(inv.admission.url, AUTH, prefix="gen-waves", requests=12, concurrency=6, max_new_tokens=40) as load:
        proc = cli(inv_dir, "deploy", "--topology", "1p1d", "--unfenced")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "although the generation changes (--unfenced)" in proc.stdout, proc.stdout
    failed = [r for r in load.rows if not r.ok]
    crossed = [r for r in failed if "generation mismatch" in str(r.error)]
    print(f"\ngeneration change rolled in waves under load: {len(load.rows)} requests, {len(failed)} failed, "
          f"{len(crossed)} of them naming the generation mismatch")
    assert crossed, [r.to_dict() for r in failed[:3]] or "no request paired across generations"
