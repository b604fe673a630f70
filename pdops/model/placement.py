"""Placement: topology -> instances -> hosts, GPUs and ports, with stable IDs.

An instance (`p01`, `d03`) is one SGLang server of TP x PP GPUs: a slot of GPUs on one
host, or whole hosts when it spans several (`--nnodes`). Placement is pure and stable:
given the placement of the current revision, instances that remain keep exactly their
hosts, GPUs and ports; new ones take free slots; removed ones are the highest-numbered.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdops.errors import InvalidInput, one_of
from pdops.model.inventory import Host, Inventory
from pdops.model.topology import Topology

ROLES = ("prefill", "decode")
PREFIX = {"prefill": "p", "decode": "d"}


@dataclass(frozen=True)
class Rank:
    """One node of an instance: a host and the GPUs it contributes."""

    node_rank: int
    host: str
    data_addr: str
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class Instance:
    id: str
    role: str
    ranks: tuple[Rank, ...]
    slot: int
    http_port: int
    bootstrap_port: int | None
    dist_init_port: int | None

    @property
    def nnodes(self) -> int:
        return len(self.ranks)

    @property
    def head(self) -> Rank:
        return self.ranks[0]

    @property
    def url(self) -> str:
        return f"http://{self.head.data_addr}:{self.http_port}"

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(r.host for r in self.ranks)

    def unit(self, node_rank: int = 0) -> str:
        return unit_name(self.id, node_rank, self.nnodes)

    @property
    def units(self) -> tuple[tuple[str, str], ...]:
        """(host, unit) for every rank, rank 0 first."""
        return tuple((r.host, self.unit(r.node_rank)) for r in self.ranks)


@dataclass(frozen=True)
class Placement:
    topology: Topology
    instances: tuple[Instance, ...]

    def get(self, instance_id: str) -> Instance:
        for inst in self.instances:
            if inst.id == instance_id:
                return inst
        raise InvalidInput("--instance", f"no instance {instance_id!r} in this placement",
                           fix=one_of([i.id for i in self.instances], instance_id, "instance", of="this placement") if self.instances
                           else "this placement has no instance")

    def role(self, role: str) -> tuple[Instance, ...]:
        return tuple(i for i in self.instances if i.role == role)

    def on_host(self, host: str) -> tuple[Instance, ...]:
        return tuple(i for i in self.instances if host in i.hosts)

    def to_dict(self) -> dict:
        return {"topology": str(self.topology), "instances": [asdict(i) for i in self.instances]}

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        insts = []
        for i in d["instances"]:
            ranks = tuple(Rank(r["node_rank"], r["host"], r["data_addr"], tuple(r["gpus"])) for r in i["ranks"])
            insts.append(Instance(i["id"], i["role"], ranks, i["slot"], i["http_port"], i["bootstrap_port"],
                                  i["dist_init_port"]))
        # Counted, not parsed: a forced drain may leave a role at zero (e.g. 1p0d).
        topo = Topology(sum(i.role == "prefill" for i in insts), sum(i.role == "decode" for i in insts))
        return cls(topo, tuple(insts))


def unit_name(instance_id: str, node_rank: int = 0, nnodes: int = 1) -> str:
    return f"pdops-{instance_id}.service" if nnodes == 1 else f"pdops-{instance_id}-r{node_rank}.service"


def instance_id(role: str, n: int) -> str:
    return f"{PREFIX[role]}{n:02d}"


def _shape(inv: Inventory) -> tuple[int, int]:
    """(GPUs per instance, hosts per instance); validates TP x PP against the hosts."""
    g = inv.profile.gpus_per_instance
    counts = {h.gpu_count for h in inv.hosts}
    for h in inv.hosts:
        if g <= h.gpu_count and h.gpu_count % g != 0:
            raise InvalidInput("profile.parallel", f"TP x PP = {g} GPUs does not divide the {h.gpu_count} GPUs of {h.name}",
                               fix="choose TP x PP that divides the GPUs per host (e.g. 8 on 8-GPU hosts)")
        if g > h.gpu_count and g % h.gpu_count != 0:
            raise InvalidInput("profile.parallel", f"TP x PP = {g} GPUs is not a whole number of {h.name}'s {h.gpu_count}-GPU hosts",
                               fix="an instance spanning hosts must use whole hosts (TP x PP a multiple of GPUs per host)")
    if g > min(counts) and len(counts) > 1:
        raise InvalidInput("profile.parallel", "an instance spanning hosts needs hosts with equal GPU counts",
                           fix="group hosts with the same GPU count in this inventory")
    per_host = min(counts)
    return g, (1 if g <= per_host else g // per_host)


def gpu_slots(inv: Inventory) -> list[tuple[tuple[Host, ...], int, tuple[int, ...]]]:
    """Every slot, in host order: (hosts, slot index on those hosts, local GPU indices)."""
    g, nhosts = _shape(inv)
    out = []
    if nhosts == 1:
        for h in inv.hosts:
            for s in range(h.gpu_count // g):
                out.append(((h,), s, tuple(range(s * g, (s + 1) * g))))
    else:
        hosts = list(inv.hosts)
        for i in range(0, len(hosts) - nhosts + 1, nhosts):
            group = tuple(hosts[i:i + nhosts])
            out.append((group, 0, tuple(range(group[0].gpu_count))))
    return out


def make_instance(inv: Inventory, role: str, n: int, slot: tuple[tuple[Host, ...], int, tuple[int, ...]],
          alt: bool = False) -> Instance:
    """The instance `role` n on `slot`. `alt`: a prefill on the slot's second bootstrap port (base + 1):
    a replacement takes the port its predecessor did not use, so that no decode holds a cached route
    to the old process at that address (SGLang's decode keys its bootstrap cache by host:port)."""
    hosts, s, gpus = slot
    p = inv.ports
    ranks = tuple(Rank(k, h.name, h.data_addr, gpus) for k, h in enumerate(hosts))
    return Instance(
        id=instance_id(role, n), role=role, ranks=ranks, slot=s,
        http_port=p.http_base + p.stride * s,
        bootstrap_port=(p.bootstrap_base + p.stride * s + (1 if alt else 0)) if role == "prefill" else None,
        dist_init_port=(p.dist_init_base + p.stride * s) if len(hosts) > 1 else None,
    )


def uses_alt_port(inv: Inventory, inst: Instance) -> bool:
    return inst.bootstrap_port is not None and inst.bootstrap_port == inv.ports.bootstrap_base + inv.ports.stride * inst.slot + 1


def remake(inv: Inventory, inst: Instance, *, alt: bool | None = None) -> Instance:
    """`inst` as the inventory places it now (same id and slot; addresses and ports from the inventory);
    InvalidInput when its hosts or slot are gone from the inventory."""
    by_key = {(tuple(h.name for h in hs), s): (hs, s, gpus) for hs, s, gpus in gpu_slots(inv)}
    key = _slot_key(inst)
    if key not in by_key:
        gone = [h for h in inst.hosts if h not in {x.name for x in inv.hosts}]
        raise InvalidInput("inventory", f"{inst.id} ({inst.role}) runs on {'/'.join(inst.hosts)} slot {inst.slot}, which "
                           "this inventory no longer has" + (f" ({', '.join(gone)} removed)" if gone else ""),
                           fix=f"move it first: `inv drain --host {inst.hosts[0]}` (or a topology without it), then "
                               "remove the host")
    return make_instance(inv, inst.role, int(inst.id[1:]), by_key[key], uses_alt_port(inv, inst) if alt is None else alt)


def slot_name(inst: Instance) -> str:
    return f"{'/'.join(inst.hosts)}#{inst.slot}"


def last_bootstrap_ports(previous: dict, pl: Placement) -> dict[str, int]:
    """{slot: the bootstrap port its last prefill used}: `previous` (a revision's record of it)
    updated with the prefills of `pl`."""
    out = dict(previous or {})
    for i in pl.role("prefill"):
        out[slot_name(i)] = i.bootstrap_port
    return dict(sorted(out.items()))


def place_change(inv: Inventory, topo: Topology, current: Placement, avoid: frozenset[str] = frozenset(),
                 fresh_ports: frozenset[str] = frozenset(), last_ports: dict | None = None) -> Placement:
    """The smallest change from `current` to `topo`: every instance of `current` keeps its id and slot
    (ids need not be contiguous); a role with too many loses those on `avoid` hosts (cordoned) first,
    then the highest-numbered; a role with too few gets the lowest unused ids on free slots off the
    `avoid` hosts, slots no instance of `current` holds first (so they start before anything drains).
    An added prefill takes the bootstrap port its slot's last prefill did not use (`last_ports`, as
    recorded; else the one of the instance `current` has there), as does every prefill in
    `fresh_ports` (replacements): a decode may still hold a route to the old process at that port."""
    slots = gpu_slots(inv)
    held = {_slot_key(i): i for i in current.instances}
    out: list[Instance] = []
    for role in ROLES:
        mine = [remake(inv, i) for i in current.role(role)]
        extra = len(mine) - topo.count(role)
        if extra > 0:
            drop = sorted(mine, key=lambda i: (not set(i.hosts) & avoid, -int(i.id[1:])))[:extra]
            mine = [i for i in mine if i not in drop]
        out += mine
    used = {_slot_key(i) for i in out}
    free = [sl for sl in slots if (tuple(h.name for h in sl[0]), sl[1]) not in used
            and not {h.name for h in sl[0]} & avoid]
    free.sort(key=lambda sl: (tuple(h.name for h in sl[0]), sl[1]) in held)  # stable: free-now slots first
    for role in ROLES:
        have = [i for i in out if i.role == role]
        taken = {int(i.id[1:]) for i in have}
        n = 0
        for _ in range(topo.count(role) - len(have)):
            if not free:
                g, _nh = _shape(inv)
                raise InvalidInput("--topology", f"{topo} needs {topo.prefill + topo.decode} instances of {g} GPUs; "
                                   f"the inventory has room for {len(slots)}"
                                   + (f", {', '.join(sorted(avoid))} cordoned" if avoid else ""),
                                   fix="choose a smaller topology, or add hosts to the inventory")
            n += 1
            while n in taken:
                n += 1
            sl = free.pop(0)
            key = (tuple(h.name for h in sl[0]), sl[1])
            prev = held.get(key)
            base = inv.ports.bootstrap_base + inv.ports.stride * sl[1]
            last = (last_ports or {}).get(f"{'/'.join(key[0])}#{key[1]}")
            if last is None and prev is not None and prev.role == "prefill":
                last = prev.bootstrap_port
            alt = role == "prefill" and last == base
            out.append(make_instance(inv, role, n, sl, alt))
    final = []
    for i in out:
        if i.id in fresh_ports and i.role == "prefill":
            i = make_instance(inv, i.role, int(i.id[1:]), _slot_of(inv, i), not uses_alt_port(inv, i))
        final.append(i)
    final.sort(key=lambda i: (ROLES.index(i.role), int(i.id[1:])))
    return Placement(topo, tuple(final))


def _slot_of(inv: Inventory, inst: Instance):
    for sl in gpu_slots(inv):
        if (tuple(h.name for h in sl[0]), sl[1]) == _slot_key(inst):
            return sl
    raise InvalidInput("inventory", f"{inst.id}: slot {inst.slot} on {'/'.join(inst.hosts)} is not in the inventory")


def _slot_key(inst: Instance) -> tuple[tuple[str, ...], int]:
    return (inst.hosts, inst.slot)


def place(inv: Inventory, topo: Topology, previous: Placement | None = None) -> Placement:
    """Place `topo` on `inv`, keeping every instance of `previous` that remains exactly where it was."""
    slots = gpu_slots(inv)
    need = topo.prefill + topo.decode
    if need > len(slots):
        g, nh = _shape(inv)
        raise InvalidInput("--topology", f"{topo} needs {need} instances of {g} GPUs, the inventory has room for {len(slots)} "
                           f"({len(inv.hosts)} hosts x {inv.hosts[0].gpu_count} GPUs)",
                           fix=f"choose a topology of at most {len(slots)} instances in all, or add hosts")
    by_key = {(tuple(h.name for h in hs), s): (hs, s, gpus) for hs, s, gpus in slots}
    kept: dict[str, Instance] = {}
    used: set = set()
    if previous is not None:
        for inst in previous.instances:
            n = int(inst.id[1:])
            if n <= topo.count(inst.role):
                key = _slot_key(inst)
                if key not in by_key:
                    raise InvalidInput("inventory", f"{inst.id} runs on {'/'.join(inst.hosts)} slot {inst.slot}, "
                                       "which this inventory no longer has",
                                       fix="restore the host in the inventory, or drain the instance first")
                fresh = make_instance(inv, inst.role, n, by_key[key])
                if fresh != inst:
                    raise InvalidInput("inventory", f"{inst.id} would move (its host's addresses or ports changed)",
                                       fix="keep the inventory of the running revision, or drain and re-add the instance")
                kept[inst.id] = inst
                used.add(key)
    free = [sl for sl in slots if (tuple(h.name for h in sl[0]), sl[1]) not in used]
    instances: list[Instance] = []
    for role in ROLES:
        for n in range(1, topo.count(role) + 1):
            iid = instance_id(role, n)
            if iid in kept:
                instances.append(kept[iid])
            else:
                instances.append(make_instance(inv, role, n, free.pop(0)))
    return Placement(topo, tuple(instances))


def placement_table(pl: Placement) -> list[dict]:
    """Rows for the placement table (instance, role, hosts, ranks, GPUs, ports)."""
    rows = []
    for i in pl.instances:
        rows.append({
            "instance": i.id, "role": i.role, "hosts": ",".join(i.hosts), "ranks": i.nnodes,
            "gpus": ",".join(map(str, i.head.gpus)), "http": i.http_port,
            "bootstrap": i.bootstrap_port or "-", "dist_init": i.dist_init_port or "-",
        })
    return rows
