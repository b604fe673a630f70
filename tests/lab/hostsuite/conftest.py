"""The host suite runs only against hosts given with --hosts (testinfra), never locally.

Run by tests/lab/test_lab.py as:
    pytest tests/lab/hostsuite --hosts=ansible://all --ansible-inventory=<lab inventory>
A plain `pytest tests` does not collect it (testinfra would otherwise test this machine).
"""


def pytest_ignore_collect(collection_path, config):
    try:
        hosts = config.getoption("hosts")
    except ValueError:
        hosts = None
    return not hosts or None
