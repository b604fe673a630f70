"""The generation of an instance: everything that must match between a prefill and the decodes it
sends KV to, and a short digest of it.

During a rolling change old and new instances serve side by side and the gateway pairs any prefill
with any decode. Two instances of one generation can be paired; a change that alters a field below
makes a new generation, whose prefills send KV an old decode cannot read (SGLang 0.5.23's decode
refuses another page size or KV dtype, `disaggregation/common/conn.py` `try_ensure_parallel_info`,
and fails each room of a prefill with another allocation policy).

What a generation is (the choice, docs/changes.md "Generations"): the fields of the whole P+D
configuration a prefill is paired in. **Shared** fields (the model, the KV's bytes, the transfer
protocol, the pinned versions) must be equal on both sides. The **layout** (TP, PP, EP, DP, attention
CP, KV sharding) is kept per role, `prefill_*` and `decode_*`: SGLang lets a decode's TP differ from
its prefill's (the decode reads the prefill's layout at bootstrap and maps its ranks onto it), so a
layout is not required to be equal across roles; but a configuration whose prefill or decode layout
changes is a new generation, since pdops has not shown that the old and the new layouts pair. So:

- `generation_fields(args)` holds one instance's shared fields and its own role's layout;
- `pair_fields(own, peers)` adds the layout of the role it is paired with: the generation fields of
  that instance in its configuration. A prefill and a decode compute the same pair fields exactly
  when their shared fields are equal; that is what the sim compares at its handshake;
- `generations(files, placement)` gives every instance of a rendered revision its generation.

Pure: reads no host; the flags are parsed with SGLang's own flag table (`sglang_flags`), so
abbreviations, types and defaults are SGLang's.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdops.errors import InvalidInput
from pdops.model.sglang_flags import FLAGS
from pdops.model.versions import MOONCAKE_VERSION, SGLANG_VERSION

# ---------------------------------------------------------------- SGLang's parser

_TYPES = {"int": int, "float": float, None: str}


def sglang_parser(**kw) -> argparse.ArgumentParser:
    """An argparse parser accepting exactly SGLang 0.5.23's launch_server flags (the sim's too)."""
    p = argparse.ArgumentParser(**kw)
    by_dest: dict[str, list] = {}
    for opt, dest, kind, typ, choices, default in FLAGS:
        by_dest.setdefault(dest, []).append((opt, kind, typ, choices, default))
    for dest, rows in by_dest.items():
        opts = [r[0] for r in rows]
        _, kind, typ, choices, default = rows[0]
        a: dict = {"dest": dest, "default": default}
        if kind == "flag":
            a["action"] = "store_true"
        elif kind == "flag_false":
            a["action"] = "store_false"
        else:
            a["type"] = _TYPES.get(typ, str)
            if choices is not None:
                a["choices"] = list(choices)
            if kind == "multi":
                a["nargs"] = "*"
            elif kind == "optional":
                a["nargs"] = "?"
        if dest == "model_path":
            a["required"] = True
        p.add_argument(*opts, **a)
    return p


def parse_sglang_args(args: list[str]) -> dict:
    """Every SGLang flag's value (its dest -> value, defaults filled in) for an engine's argument list;
    InvalidInput with argparse's message where SGLang's parser would refuse it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return vars(sglang_parser(prog="sglang.launch_server").parse_args(list(args)))
    except SystemExit:
        msg = err.getvalue().strip().splitlines()
        raise InvalidInput("engine flags", msg[-1] if msg else "SGLang's parser refused them",
                           fix="fix the profile or the rendering; SGLang would refuse to start") from None


# ---------------------------------------------------------------- the fields

@dataclass(frozen=True)
class Field:
    key: str  # in the fields dict (a layout field's key is prefixed with the role: prefill_tp)
    label: str  # in a diff line
    source: str  # the SGLang flag(s) or the version pin it is read from
    scope: str  # "shared": equal on both sides | "layout": per role
    reason: str


MOONCAKE_BACKENDS = ("mooncake", "mooncake_tcp")

FIELDS: tuple[Field, ...] = (
    Field("model_path", "model", "--model-path", "shared",
          "the weights that computed the KV: a decode continuing another model's KV gives garbage, no error"),
    Field("revision", "model revision", "--revision", "shared",
          "the same path at another revision is other weights"),
    Field("served_model_name", "served model name", "--served-model-name", "shared",
          "no KV byte, but the gateway selects workers by model id and a client's model must be served by both"),
    Field("dtype", "model dtype", "--dtype", "shared",
          "with --kv-cache-dtype auto the KV is stored in the model dtype (SGLang resolves and publishes it)"),
    Field("quantization", "quantization", "--quantization", "shared",
          "other weights computed the KV, and a quantized checkpoint may resolve another KV dtype"),
    Field("kv_cache_dtype", "KV cache dtype", "--kv-cache-dtype", "shared",
          "bytes per KV element; SGLang's decode refuses a prefill of another kv_cache_dtype"),
    Field("page_size", "page size", "--page-size", "shared",
          "KV moves as pages addressed by index; SGLang's decode refuses a prefill of another page_size"),
    Field("attention_backends", "attention backends",
          "--attention-backend, --prefill-attention-backend, --decode-attention-backend", "shared",
          "FlashMLA, TRT-LLM MLA/MHA, CuteDSL MLA and HPC-Ops force their own page size "
          "(arg_groups/overrides.py); compared as given, not as resolved (conservative)"),
    Field("dsv4_attn_backend", "DeepSeek-V4 attention backend", "--dsv4-attn-backend", "shared",
          "selects the DeepSeek-V4 pools' kv_layout, which SGLang's decode refuses to mix"),
    Field("page_major_kv_layout", "page-major KV layout", "--enable-page-major-kv-layout", "shared",
          "orders the KV buffers page-major instead of layer-major: other bytes at the same address"),
    Field("speculative", "speculative decoding", "--speculative-algorithm, --speculative-draft-model-path",
          "shared", "with a draft model the prefill appends the draft's KV buffers to what it transfers"),
    Field("transfer_backend", "transfer backend", "--disaggregation-transfer-backend", "shared",
          "the engine that moves the KV (Mooncake, NIXL, ...): both ends must speak it"),
    Field("kv_checksum", "KV checksum", "--disaggregation-enable-kv-checksum", "shared",
          "adds a metadata buffer; metadata buffers pair by position, so one side alone misaligns them"),
    Field("decode_allocation_policy", "decode allocation policy", "--disaggregation-decode-allocation-policy",
          "shared", "when the decode allocates and sends its metadata; SGLang's decode fails every room "
          "of a prefill with another policy"),
    Field("sglang_version", "SGLang version", "pdops.model.versions.SGLANG_VERSION (PDOPS_SGLANG_VERSION)",
          "shared", "the bootstrap protocol and the KV pool layout are SGLang's and change between releases"),
    Field("mooncake_version", "Mooncake version", "pdops.model.versions.MOONCAKE_VERSION (PDOPS_MOONCAKE_VERSION)",
          "shared", "the transfer engine's wire protocol; only with a Mooncake transfer backend (else unset)"),
    Field("tp", "TP", "--tp-size", "layout",
          "attention heads per rank: the decode maps its ranks onto the prefill's (SGLang allows them to differ)"),
    Field("pp", "PP", "--pp-size", "layout",
          "layers per rank; SGLang's decode needs the prefill's PP or 1"),
    Field("ep", "EP", "--ep-size", "layout",
          "expert placement: no KV byte by itself (attention is sharded by TP/DP), kept as part of the "
          "layout pdops deploys as a unit"),
    Field("dp", "DP", "--dp-size", "layout",
          "data-parallel replicas in the instance: the prefill publishes which one holds a request's KV"),
    Field("dp_attention", "DP attention", "--enable-dp-attention", "layout",
          "attention sharded by DP instead of TP: the attention TP the decode maps onto is tp/dp"),
    Field("attn_cp", "attention CP", "--attention-context-parallel-size", "layout",
          "the prefill's KV split over context-parallel ranks; SGLang's decode must be CP 1"),
    Field("kv_cache_sharding", "KV cache sharding", "--enable-kv-cache-sharding", "layout",
          "each prefill rank owns a subset of the pages: the decode pulls from all of them"),
)

SHARED = tuple(f for f in FIELDS if f.scope == "shared")
LAYOUT = tuple(f for f in FIELDS if f.scope == "layout")
ROLES = ("prefill", "decode")


def versions_from_env(env: Mapping[str, str]) -> dict:
    """The version pins an engine runs with: its env file's PDOPS_SGLANG_VERSION and
    PDOPS_MOONCAKE_VERSION, else this pdops's pins."""
    return {"sglang": env.get("PDOPS_SGLANG_VERSION") or SGLANG_VERSION,
            "mooncake": env.get("PDOPS_MOONCAKE_VERSION") or MOONCAKE_VERSION}


def _role(a: Mapping) -> str:
    return a.get("disaggregation_mode") or "null"


def fields_from_parsed(a: Mapping, versions: Mapping | None = None) -> dict:
    """One instance's generation fields from its parsed SGLang flags (`parse_sglang_args`, or the
    sim's own parse): the shared fields and its own role's layout (`prefill_tp`, ...)."""
    v = {"sglang": SGLANG_VERSION, "mooncake": MOONCAKE_VERSION, **(versions or {})}
    backend = a.get("disaggregation_transfer_backend") or "mooncake"
    spec = a.get("speculative_algorithm")
    out = {
        "model_path": a.get("model_path"),
        "revision": a.get("revision"),
        # SGLang serves the model path when no name is given
        "served_model_name": a.get("served_model_name") or a.get("model_path"),
        "dtype": a.get("dtype") or "auto",
        "quantization": a.get("quantization"),
        "kv_cache_dtype": a.get("kv_cache_dtype") or "auto",
        "page_size": a.get("page_size"),
        "attention_backends": [a.get("attention_backend"), a.get("prefill_attention_backend"),
                               a.get("decode_attention_backend")],
        "dsv4_attn_backend": a.get("dsv4_attn_backend") or "auto",
        "page_major_kv_layout": bool(a.get("enable_page_major_kv_layout")),
        "speculative": [spec, a.get("speculative_draft_model_path")] if spec else None,
        "transfer_backend": backend,
        "kv_checksum": bool(a.get("disaggregation_enable_kv_checksum")),
        "decode_allocation_policy": a.get("disaggregation_decode_allocation_policy") or "early",
        "sglang_version": v["sglang"],
        "mooncake_version": v["mooncake"] if backend in MOONCAKE_BACKENDS else None,
    }
    role = _role(a)
    layout = {
        "tp": a.get("tp_size") or 1,
        "pp": a.get("pp_size") or 1,
        "ep": a.get("ep_size") or 1,
        "dp": a.get("dp_size") or 1,
        "dp_attention": bool(a.get("enable_dp_attention")),
        "attn_cp": a.get("attn_cp_size") or 1,
        "kv_cache_sharding": bool(a.get("enable_kv_cache_sharding")),
    }
    out["role"] = role
    out.update({f"{role}_{k}": val for k, val in layout.items()})
    return out


def generation_fields(args: list[str], versions: Mapping | None = None) -> dict:
    """One instance's generation fields from its SGLang argument list (as `commands.engine_args` gives
    it) and the version pins it runs with (default: this pdops's)."""
    return fields_from_parsed(parse_sglang_args(args), versions)


def shared_fields(fields: Mapping) -> dict:
    """The fields both sides must hold equal."""
    return {f.key: fields.get(f.key) for f in SHARED}


def _layout_of(fields: Mapping, role: str) -> dict:
    return {f"{role}_{f.key}": fields[f"{role}_{f.key}"] for f in LAYOUT if f"{role}_{f.key}" in fields}


def pair_fields(own: Mapping, peers: Iterable[Mapping]) -> dict:
    """The generation fields of an instance in its configuration: its own fields plus the layout of
    the other role's instances it is paired with (one value when they agree, else the sorted list of
    their values). The role key is dropped: a prefill and a decode of one configuration have equal
    pair fields when, and only when, their shared fields are equal."""
    out = {k: val for k, val in own.items() if k != "role"}
    role = own.get("role")
    if role not in ROLES:
        return out
    other = ROLES[1 - ROLES.index(role)]
    layouts = [_layout_of(p, other) for p in peers]
    for f in LAYOUT:
        key = f"{other}_{f.key}"
        vals = {json.dumps(lay[key], sort_keys=True) for lay in layouts if key in lay}
        if vals:
            ordered = [json.loads(s) for s in sorted(vals)]
            out[key] = ordered[0] if len(ordered) == 1 else ordered
    return out


def digest(fields: Mapping) -> str:
    """A short sha256 (12 hex digits) of the fields, key order aside."""
    text = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _label(key: str) -> str:
    for f in FIELDS:
        if key == f.key:
            return f.label
        for role in ROLES:
            if key == f"{role}_{f.key}":
                return f"{role} {f.label}"
    return key.replace("_", " ")


def _show(v) -> str:
    if v is None:
        return "unset"
    if isinstance(v, list):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return str(v).lower() if isinstance(v, bool) else str(v)


def generation_diff(old_fields: Mapping, new_fields: Mapping) -> list[str]:
    """What changed, one line per field in the table's order: "page size 64 -> 32"."""
    order = [f.key for f in SHARED] + [f"{r}_{f.key}" for r in ROLES for f in LAYOUT]
    keys = [k for k in order if k in old_fields or k in new_fields]
    keys += sorted((set(old_fields) | set(new_fields)) - set(order) - {"role"})
    return [f"{_label(k)} {_show(old_fields.get(k))} -> {_show(new_fields.get(k))}"
            for k in keys if old_fields.get(k) != new_fields.get(k)]


# ---------------------------------------------------------------- a rendered revision

@dataclass(frozen=True)
class Generation:
    fields: dict
    digest: str


def launch_args(script: str) -> list[str]:
    """The engine's flags from a rendered launch script: what follows `-m <module>` on its exec line."""
    for line in reversed(script.splitlines()):
        if line.startswith("exec "):
            argv = shlex.split(line)[1:]
            if "-m" in argv:
                return argv[argv.index("-m") + 2:]
    raise InvalidInput("launch script", "no `exec ... -m MODULE FLAGS` line", fix="render the revision again")


def env_values(env_file: str) -> dict[str, str]:
    """KEY=VALUE lines of a rendered env file (systemd EnvironmentFile quoting)."""
    out = {}
    for line in env_file.splitlines():
        if not line or line.startswith("#") or "=" not in line:
            continue
        k, v = line.split("=", 1)
        if len(v) >= 2 and v[0] == v[-1] == '"':
            v = v[1:-1].replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
        out[k.strip()] = v
    return out


def generations(files: Iterable, placement) -> dict[str, Generation]:
    """{instance id: Generation} of every instance of a rendered revision: `files` are its rendered
    files (`render.render_files`, or a snapshot's `render.files_of`), `placement` its placement. Each
    instance's flags and version pins are read from its rank-0 launch script and env file, so a
    recorded revision gives what its processes were started with."""
    by_name = {(f.host, f.path.rsplit("/", 1)[-1]): f.content for f in files}
    own = {}
    for inst in placement.instances:
        stem = inst.unit(0).removesuffix(".service")
        host = inst.head.host
        script, env = by_name.get((host, stem + ".sh")), by_name.get((host, stem + ".env"))
        if script is None or env is None:
            raise InvalidInput(f"instance {inst.id}", f"no launch script or env file {stem}.sh/.env on {host}",
                               fix="pass the revision's rendered files")
        own[inst.id] = fields_from_parsed(parse_sglang_args(launch_args(script)), versions_from_env(env_values(env)))
    out = {}
    for inst in placement.instances:
        peers = [own[i.id] for i in placement.instances if i.role != inst.role]
        f = pair_fields(own[inst.id], peers)
        out[inst.id] = Generation(f, digest(f))
    return out


def mismatch(prefill_own: Mapping, decode_own: Mapping) -> str | None:
    """None when a prefill and a decode (each one's `generation_fields`) are of one generation; else
    a message naming both generations (each side's view of the pair) and what differs."""
    p = pair_fields(prefill_own, [decode_own])
    d = pair_fields(decode_own, [prefill_own])
    if p == d:
        return None
    return (f"generation mismatch: prefill {digest(p)}, decode {digest(d)} "
            f"({'; '.join(generation_diff(p, d))})")
