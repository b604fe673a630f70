"""The generation digest (pdops.model.generation): what must match between a prefill and its decodes."""

from __future__ import annotations

import pytest

from pdops.errors import InvalidInput
from pdops.model.generation import (FIELDS, generation_diff, generation_fields, generations, digest, mismatch,
                                    pair_fields, versions_from_env)
from pdops.model.placement import place
from pdops.model.commands import engine_args, override_args
from pdops.model.render import RenderedFile, render_files
from pdops.model.topology import parse_topology
from pdops.model.versions import MOONCAKE_VERSION, SGLANG_VERSION


def _args(inv, topo="1p1d", role="prefill"):
    pl = place(inv, parse_topology(topo))
    inst = pl.role(role)[0]
    return engine_args(inv, pl, inst, inst.head)


# How each field of the table is changed: flags set on the rendered args (override_args), or pins.
CHANGES = {
    "model_path": ([("--model-path", "/models/other")], None),
    "revision": ([("--revision", "abc123")], None),
    "served_model_name": ([("--served-model-name", "other")], None),
    "dtype": ([("--dtype", "float16")], None),
    "quantization": ([("--quantization", "fp8")], None),
    "kv_cache_dtype": ([("--kv-cache-dtype", "fp8_e4m3")], None),
    "page_size": ([("--page-size", "64")], None),
    "attention_backends": ([("--decode-attention-backend", "flashmla")], None),
    "dsv4_attn_backend": ([("--dsv4-attn-backend", "flashmla")], None),
    "page_major_kv_layout": ([("--enable-page-major-kv-layout", None)], None),
    "speculative": ([("--speculative-algorithm", "EAGLE"), ("--speculative-draft-model-path", "/models/d")], None),
    "transfer_backend": ([("--disaggregation-transfer-backend", "nixl")], None),
    "kv_checksum": ([("--disaggregation-enable-kv-checksum", None)], None),
    "decode_allocation_policy": ([("--disaggregation-decode-allocation-policy", "prefill_complete")], None),
    "sglang_version": ([], {"sglang": "0.5.24"}),
    "mooncake_version": ([], {"mooncake": "0.3.8"}),
    "tp": ([("--tp-size", "4"), ("--ep-size", "4")], None),
    "pp": ([("--pp-size", "2")], None),
    "ep": ([("--ep-size", "1")], None),
    "dp": ([("--dp-size", "2")], None),
    "dp_attention": ([("--enable-dp-attention", None)], None),
    "attn_cp": ([("--attn-cp-size", "2")], None),
    "kv_cache_sharding": ([("--enable-kv-cache-sharding", None)], None),
}


def test_every_field_has_a_source_a_reason_and_a_case_here():
    assert {f.key for f in FIELDS} == set(CHANGES)
    assert all(f.source and f.reason and f.scope in ("shared", "layout") for f in FIELDS)


@pytest.mark.parametrize("inventory", ["lab_inv", "fleet"])
def test_fields_of_the_rendered_args(inventory, request):
    inv = request.getfixturevalue(inventory)
    f = generation_fields(_args(inv))
    prof = inv.profile
    assert f["model_path"] == prof.model_path and f["served_model_name"] == prof.served_model_name
    assert f["transfer_backend"] == prof.transfer_backend and f["sglang_version"] == SGLANG_VERSION
    assert f["mooncake_version"] == (MOONCAKE_VERSION if prof.transfer_backend == "mooncake" else None)
    assert f["role"] == "prefill" and f["prefill_tp"] == prof.tp and f["prefill_pp"] == prof.pp
    assert f["prefill_ep"] == prof.ep and "decode_tp" not in f
    assert f["page_size"] == prof.bundle.get("page_size") and f["kv_cache_dtype"] == "auto"
    d = generation_fields(_args(inv, role="decode"))
    assert d["role"] == "decode" and d["decode_tp"] == prof.tp
    # a homogeneous configuration: the prefill's and the decode's view of the pair are one generation
    assert mismatch(f, d) is None
    assert pair_fields(f, [d]) == pair_fields(d, [f])


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_each_field_changes_the_digest(lab_inv, key):
    args = _args(lab_inv)
    flags, versions = CHANGES[key]
    base = generation_fields(args)
    new = generation_fields(override_args(args, flags), versions)
    assert new[key if key in base else f"prefill_{key}"] != base.get(key if key in base else f"prefill_{key}")
    assert digest(new) != digest(base)
    assert generation_diff(base, new)


@pytest.mark.parametrize("flags", [
    [("--mem-fraction-static", "0.7")], [("--log-level", "debug")], [("--chunked-prefill-size", "4096")],
    [("--max-running-requests", "2")], [("--context-length", "65536")], [("--host", "10.0.0.9")],
    [("--port", "31000")], [("--disaggregation-bootstrap-port", "9998")], [("--disaggregation-ib-device", "mlx5_3")],
    [("--enable-metrics", False)], [("--log-requests", False)],
])
def test_an_unrelated_flag_does_not_change_the_digest(lab_inv, flags):
    args = _args(lab_inv)
    assert digest(generation_fields(override_args(args, flags))) == digest(generation_fields(args))


def test_parsed_as_sglang_parses_abbreviations_and_defaults(lab_inv):
    args = _args(lab_inv)
    short = override_args(args, [("--tp-size", False), ("--page-size", False)]) + ["--tp", "8"]
    assert generation_fields(short) == generation_fields(args)
    explicit = override_args(args, [("--kv-cache-dtype", "auto"), ("--disaggregation-decode-allocation-policy", False)])
    assert generation_fields(explicit) == generation_fields(args)  # SGLang's defaults: auto, early
    with pytest.raises(InvalidInput):
        generation_fields(args + ["--no-such-flag"])
    with pytest.raises(InvalidInput):
        generation_fields(override_args(args, [("--kv-cache-dtype", "int3")]))


def test_mooncake_pin_counts_only_with_a_mooncake_backend(lab_inv):
    nixl = override_args(_args(lab_inv), [("--disaggregation-transfer-backend", "nixl")])
    assert generation_fields(nixl)["mooncake_version"] is None
    assert digest(generation_fields(nixl, {"mooncake": "9"})) == digest(generation_fields(nixl))


def test_diff_text():
    old = {"page_size": 64, "kv_cache_dtype": "auto", "decode_tp": 8, "sglang_version": "0.5.23", "revision": None}
    new = {"page_size": 32, "kv_cache_dtype": "fp8_e4m3", "decode_tp": 4, "sglang_version": "0.5.24", "revision": "r2"}
    assert generation_diff(old, new) == ["model revision unset -> r2", "KV cache dtype auto -> fp8_e4m3",
                                         "page size 64 -> 32", "SGLang version 0.5.23 -> 0.5.24", "decode TP 8 -> 4"]
    assert generation_diff(old, old) == []


def test_a_prefill_and_a_decode_of_another_page_size_mismatch_naming_both(lab_inv):
    p = generation_fields(override_args(_args(lab_inv), [("--page-size", "64")]))
    d = generation_fields(override_args(_args(lab_inv, role="decode"), [("--page-size", "32")]))
    msg = mismatch(p, d)
    assert msg == (f"generation mismatch: prefill {digest(pair_fields(p, [d]))}, decode "
                   f"{digest(pair_fields(d, [p]))} (page size 64 -> 32)")


def test_a_layout_differing_between_roles_is_one_configuration_not_a_mismatch(lab_inv):
    """SGLang lets a decode's TP differ from its prefill's: both sides still see one generation, but it
    is another generation than the homogeneous configuration's."""
    p = generation_fields(_args(lab_inv))
    d4 = generation_fields(override_args(_args(lab_inv, role="decode"), [("--tp-size", "4"), ("--ep-size", "4")]))
    d8 = generation_fields(_args(lab_inv, role="decode"))
    assert mismatch(p, d4) is None
    assert digest(pair_fields(p, [d4])) != digest(pair_fields(p, [d8]))
    assert generation_diff(pair_fields(p, [d8]), pair_fields(p, [d4])) == ["decode TP 8 -> 4", "decode EP 8 -> 4"]


@pytest.mark.parametrize("inventory,topo", [("lab_inv", "2p2d"), ("fleet", "8p4d")])
def test_every_instance_of_a_rendered_revision_has_its_generation(inventory, topo, request):
    inv = request.getfixturevalue(inventory)
    pl = place(inv, parse_topology(topo))
    files = render_files(inv, pl)
    gens = generations(files, pl)
    assert set(gens) == {i.id for i in pl.instances}
    assert len({g.digest for g in gens.values()}) == 1  # one homogeneous configuration
    p = pl.role("prefill")[0]
    assert gens[p.id].fields == pair_fields(generation_fields(engine_args(inv, pl, p, p.head)),
                                            [generation_fields(engine_args(inv, pl, d, d.head))
                                             for d in pl.role("decode")])
    # the pins are read from each instance's env file: an upgrade rendered there is a new generation
    stem = p.unit(0).removesuffix(".service")
    bumped = [RenderedFile(f.host, f.path, f.content.replace(f"PDOPS_SGLANG_VERSION={SGLANG_VERSION}",
                                                              "PDOPS_SGLANG_VERSION=0.5.24"), f.mode)
              if f.path.endswith(f"/{stem}.env") else f for f in files]
    after = generations(bumped, pl)
    assert after[p.id].digest != gens[p.id].digest
    assert generation_diff(gens[p.id].fields, after[p.id].fields) == [f"SGLang version {SGLANG_VERSION} -> 0.5.24"]
    assert after[pl.role("prefill")[1].id].digest == gens[p.id].digest


def test_versions_from_env_default_to_the_pins():
    assert versions_from_env({}) == {"sglang": SGLANG_VERSION, "mooncake": MOONCAKE_VERSION}
    assert versions_from_env({"PDOPS_SGLANG_VERSION": "0.6.0"})["sglang"] == "0.6.0"
