"""The sim's HTTP surface without PD: auth, OpenAI routes, info, metrics switch."""

from __future__ import annotations

from pdops.sim.testing import http


def test_api_key_guards_all_but_probes(sims):
    h = sims(["--api-key", "K", "--enable-metrics"])
    assert h.post("/generate", {"text": "a"})[0] == 401
    assert http("POST", h.url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}}, headers={"Authorization": "Bearer K"})[0] == 200
    assert h.get("/health")[0] == 200 and h.get("/metrics")[0] == 200


def test_openai_routes_info_and_no_metrics_without_flag(sims):
    h = sims(["--served-model-name", "m1", "--disaggregation-mode", "null"])
    s, r = h.post("/v1/completions", {"model": "m1", "prompt": "a b c", "max_tokens": 3})
    assert s == 200 and r["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    s, r = h.post("/v1/chat/completions", {"model": "m1", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 2})
    assert s == 200 and r["choices"][0]["finish_reason"] == "length" and r["usage"]["prompt_tokens"] == 2
    assert h.get("/v1/models")[1]["data"][0]["id"] == "m1"
    s, info = h.get("/server_info")
    assert s == 200 and info["disaggregation_mode"] == "null" and info["served_model_name"] == "m1"
    assert h.get("/get_model_info")[1]["model_path"] == "sim-model"
    assert h.get("/metrics")[0] == 404
