"""The `pdops_prometheus` inventory setting: where the fleet's Prometheus reads pdops's
`file_sd` target file. Read and checked with the rest of the inventory, before any SSH; what
goes into the file is :mod:`pdops.steps.targets`'s."""

from __future__ import annotations

from dataclasses import dataclass

from pdops.errors import InvalidInput, one_of

VAR = "pdops_prometheus"
DEFAULT_TARGETS_DIR = "/etc/prometheus/file_sd"


@dataclass(frozen=True)
class PrometheusConfig:
    """`pdops_prometheus: {host, targets_dir}`: where the target file is delivered (None: nowhere)."""

    host: str
    targets_dir: str = DEFAULT_TARGETS_DIR

    def targets_file(self, cluster: str) -> str:
        return f"{self.targets_dir.rstrip('/')}/pdops-{cluster}.json"


def parse_prometheus(all_vars: dict, host_names: list[str]) -> PrometheusConfig | None:
    raw = all_vars.get(VAR)
    if raw is None:
        return None
    fix = f"e.g. {VAR}: {{host: {host_names[0] if host_names else 'mon01'}, targets_dir: {DEFAULT_TARGETS_DIR}}}"
    if not isinstance(raw, dict):
        raise InvalidInput(VAR, "must be a mapping", fix=fix)
    unknown = sorted(set(raw) - {"host", "targets_dir"})
    if unknown:
        raise InvalidInput(f"{VAR}.{unknown[0]}", "unknown setting", fix="use only: host, targets_dir")
    host = raw.get("host")
    if host not in host_names:
        raise InvalidInput(f"{VAR}.host", f"{host!r} is not a host of this inventory",
                           fix=one_of(host_names, host) + " (pdops delivers the target file there over SSH)")
    d = raw.get("targets_dir", DEFAULT_TARGETS_DIR)
    if not isinstance(d, str) or not d.startswith("/") or any(c in d for c in "\n\0") or ".." in d.split("/"):
        raise InvalidInput(f"{VAR}.targets_dir", f"{d!r} is not an absolute directory path", fix=fix)
    return PrometheusConfig(host, d)
