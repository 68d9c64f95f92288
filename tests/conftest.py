import os
import pytest

import hcq


@pytest.fixture(scope="session")
def dev():
    return hcq.Device("CPU")


@pytest.fixture(scope="session")
def dev1():
    return hcq.Device("CPU:1")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("HCQ_SLOW") == "1": return
    skip = pytest.mark.skip(reason="slow soak run; set HCQ_SLOW=1")
    for item in items:
        if "slow" in item.keywords: item.add_marker(skip)
