"""The sim writes SGLang's --log-requests json lines, which the drain reads per request ID."""

import json
import urllib.request

from pdops.facts import requestlog
from pdops.sim.testing import start_sim


def test_request_log_lines_parse_as_received_and_finished():
    sim = start_sim(["--log-requests", "--log-requests-level", "0", "--log-requests-format", "json"])
    try:
        body = json.dumps({"text": "hello there", "rid": "rl-1", "sampling_params": {"max_new_tokens": 3}}).encode()
        req = urllib.request.Request(sim.url + "/generate", data=body, headers={"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(req, timeout=10).read())["meta_info"]["id"] == "rl-1"
        log = requestlog.parse(sim.proc.log() if hasattr(sim.proc, "log") else sim.log())
        assert "rl-1" in log.received and log.finished.get("rl-1") == "length" and log.open == []
    finally:
        sim.stop()


def test_no_request_log_without_the_flag():
    sim = start_sim([])
    try:
        body = json.dumps({"text": "hi", "rid": "rl-2", "sampling_params": {"max_new_tokens": 1}}).encode()
        req = urllib.request.Request(sim.url + "/generate", data=body, headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()
        log = requestlog.parse(sim.proc.log() if hasattr(sim.proc, "log") else sim.log())
        assert log.received == {}
    finally:
        sim.stop()
