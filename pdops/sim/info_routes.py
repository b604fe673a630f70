"""The sim's probe and information routes: /health, /ready, /server_info, /model_info,
/v1/loads, /v1/models and /metrics, in SGLang's shapes."""

from __future__ import annotations

import sys

from aiohttp import web

from pdops.model.versions import SIM_VERSION
from pdops.sim.metrics import prometheus_text


class InfoRoutes:
    """SimServer's probe and information handlers (a mixin: they read its engine, args and status)."""

    def _healthy(self) -> bool:
        if self.gracefully_exit or self.status != "Up":
            return False
        n = self.faults.unhealthy_after
        if n is not None:
            if self.healthy_answers >= n:
                return False
            self.healthy_answers += 1
        return True

    async def health(self, request):
        return web.Response(status=200 if self._healthy() else 503)

    async def ready(self, request):
        return web.Response(status=200 if self._healthy() else 503)

    async def server_info(self, request):
        a = self.args
        info = dict(a.all)
        info.update(
            {
                "host": a.host,
                "port": a.port,
                "served_model_name": a.served_model_name,
                "tp_size": a.tp_size,
                "pp_size": a.pp_size,
                "dp_size": a.dp_size,
                "disaggregation_mode": a.mode,
                "disaggregation_bootstrap_port": a.bootstrap_port,
                "max_running_requests": self.engine.max_running,
                "launch_command": " ".join([sys.executable, "-m", "pdops.sim", *sys.argv[1:]]),
                "status": self.status,
                "max_total_num_tokens": self.timing.max_total_tokens,
                "startup_time": self.started,
                "internal_states": [{"last_gen_throughput": self.engine.gen_throughput(), "load": self.engine.load()["num_running_reqs"]}],
                "version": SIM_VERSION,
                "frontend": "python",
                "sim": True,
            }
        )
        if a.api_key:
            info["api_key"] = "<redacted>"
        return web.json_response(info)

    async def model_info(self, request):
        a = self.args
        return web.json_response(
            {
                "model_path": a.model_path,
                "served_model_name": a.served_model_name,
                "tokenizer_path": a.all.get("tokenizer_path") or a.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": a.all.get("weight_version", "default"),
                "load_format": a.all.get("load_format"),
                "disaggregation_mode": a.mode,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": None,
                "architectures": None,
            }
        )

    async def loads(self, request):
        from datetime import datetime, timezone

        load = self.engine.load()
        include = request.query.get("include")
        if include:
            inc = {s.strip() for s in include.split(",")}
            valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
            if not inc <= valid:
                return web.json_response({"detail": f"Invalid include sections: {inc - valid}"}, status=400)
            if "all" not in inc:
                for field, name in (("memory", "memory"), ("disaggregation", "disagg"), ("queues", "queues")):
                    if name not in inc:
                        load.pop(field)
        return web.json_response(
            {
                "timestamp": datetime.now(timezone.utc).isoformat(),
                "version": SIM_VERSION,
                "accelerator": None,
                "num_accelerators": self.args.tp_size * self.args.pp_size,
                "loads": [load],
            }
        )

    async def models(self, request):
        a = self.args
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": a.served_model_name,
                        "object": "model",
                        "created": int(self.started),
                        "owned_by": "sglang",
                        "root": a.model_path,
                        "max_model_len": a.context_length,
                    }
                ],
            }
        )

    async def metrics(self, request):
        return web.Response(text=prometheus_text(self.engine, self.args), content_type="text/plain", charset="utf-8")
