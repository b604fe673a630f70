import pytest

from pdops.errors import InvalidInput
from pdops.model.topology import Topology, parse_topology


@pytest.mark.parametrize("spec,expected", [("8p4d", Topology(8, 4)), ("8P4D", Topology(8, 4)),
                                           ("12p4d", Topology(12, 4)), (" 1p1d ", Topology(1, 1))])
def test_parses_npmd_any_case(spec, expected):
    assert parse_topology(spec) == expected
    assert str(parse_topology(spec)) == str(expected).lower()


@pytest.mark.parametrize("spec,needle", [
    ("0p4d", "at least one prefill"), ("4p0d", "at least one decode"), ("8p", "not a topology"),
    ("8p4d2x", "not a topology"), ("-1p1d", "not a topology"), ("p4d", "not a topology"),
    ("", "missing"), ("eight-p-four-d", "not a topology"),
])
def test_bad_topology_names_the_problem(spec, needle):
    with pytest.raises(InvalidInput) as e:
        parse_topology(spec)
    assert needle in str(e.value)
    assert e.value.fix and "p" in e.value.fix and "d" in e.value.fix


def test_yaml_form(tmp_path):
    f = tmp_path / "t.yml"
    f.write_text("prefill: 3\ndecode: 1\n")
    assert parse_topology(str(f)) == Topology(3, 1)
    f.write_text("prefill: 3\ndecode: [\n")
    with pytest.raises(InvalidInput, match="YAML syntax error"):
        parse_topology(str(f))
    f.write_text("prefill: 3\n")
    with pytest.raises(InvalidInput, match="exactly"):
        parse_topology(str(f))
