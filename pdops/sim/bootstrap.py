"""The prefill's bootstrap server (SGLang's CommonKVBootstrapServer): PUT/GET /route, /health."""

from __future__ import annotations

import asyncio

from aiohttp import web


class BootstrapServer:
    """Rank registry a decode reads before it connects to a prefill rank's KV endpoint."""

    def __init__(self):
        self.table: dict[tuple, dict] = {}  # (dp, cp, tp, pp) -> {rank_ip, rank_port}
        self.info: dict | None = None
        self.lock = asyncio.Lock()
        self.app = web.Application()
        self.app.router.add_route("*", "/route", self._route)
        self.app.router.add_get("/health", self._health)

    def expected(self) -> int:
        i = self.info or {}
        return i.get("dp_size", 1) * i.get("attn_cp_size", 1) * i.get("attn_tp_size", 1) * i.get("pp_size", 1)

    def ready(self) -> bool:
        return self.info is not None and len(self.table) >= self.expected()

    async def _health(self, request):
        return web.Response(text="OK")

    async def _route(self, request: web.Request):
        if request.method == "PUT":
            d = await request.json()
            policy = d.get("decode_allocation_policy", "early")
            if self.info and self.info["decode_allocation_policy"] != policy:
                return web.Response(text="Inconsistent prefill allocation policies", status=400)
            if self.info is None:
                self.info = {
                    "attn_tp_size": d["attn_tp_size"],
                    "attn_cp_size": d["attn_cp_size"],
                    "dp_size": d["attn_dp_size"] if d["system_dp_size"] == 1 else d["system_dp_size"],
                    "pp_size": d["pp_size"],
                    "page_size": int(d["page_size"]),
                    "kv_cache_dtype": d["kv_cache_dtype"],
                    "follow_bootstrap_room": d.get("load_balance_method", "follow_bootstrap_room") == "follow_bootstrap_room",
                    "enable_dsa_cache_layer_split": False,
                    "enable_kv_cache_sharding": False,
                    "prefill_http_port": d.get("prefill_http_port"),
                    "decode_allocation_policy": policy,
                    # the sim's own field: the prefill's generation fields (pdops.model.generation)
                    "pdops_generation": d.get("pdops_generation"),
                }
            dp = d["attn_dp_rank"] if d["system_dp_size"] == 1 else d["system_dp_rank"]
            async with self.lock:
                self.table[(dp, d["attn_cp_rank"], d["attn_tp_rank"], d["pp_rank"])] = {
                    "rank_ip": d["rank_ip"],
                    "rank_port": int(d["rank_port"]),
                }
            return web.Response(text="OK")
        if request.method != "GET":
            return web.Response(text="Method not allowed", status=405)
        q = request.query
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        if not all(q.get(k) for k in keys):
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        vals = tuple(int(q[k]) for k in keys)
        if not self.ready():
            return web.Response(
                text=f"Prefill server not fully registered yet ({len(self.table)} workers registered).", status=503
            )
        if vals == (-1, -1, -1, -1):
            return web.json_response(self.info)
        entry = self.table.get(vals)
        if entry is None:
            return web.Response(text=f"Bootstrap info not found for {vals}", status=404)
        return web.json_response(entry)
