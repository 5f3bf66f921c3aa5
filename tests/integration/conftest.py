from __future__ import annotations

import pytest

from tests.support.runtime import require_runtime


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def _runtime() -> None:
    require_runtime()
