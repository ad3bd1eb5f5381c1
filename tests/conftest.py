"""Shared fixtures. Without CUDA, kernels run through Triton's CPU interpreter.

TRITON_INTERPRET must be set before any fusetune.kernels module is imported (triton.jit reads it
when a kernel is decorated), so it is set here, at conftest import time.

torch runs one thread per process (OMP_NUM_THREADS=1, set here before torch is imported; the
processes the tests start inherit it; left alone where the environment sets it): pytest-xdist
runs a process per core already, and each test's worker subprocesses and `fusetune` commands run
beside it. With torch's default, a thread per core in every process, the cores are
oversubscribed and OpenMP's spinning threads slow every process down (Optuna's GP sampler 4x on
two cores). The tests' tensors are tiny: one thread loses nothing.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # see above

import torch  # (after OMP_NUM_THREADS on purpose)

# Configs tuned at run time go to a cache of this test process, never to the user's.
os.environ["FUSETUNE_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="fusetune-test-cache-"),
                                            "tuned.yaml")

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import fusetune.tables  # noqa: E402  (after TRITON_INTERPRET on purpose)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none is available)")
    for item in items:
        # the marker, not item.keywords: keywords also hold parametrize ids such as "gpu"
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture
def fresh_tables(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No user tables, no FUSETUNE_TABLES, no cached lookups or warnings, before and after."""
    monkeypatch.delenv(fusetune.tables.ENV_VAR, raising=False)
    fusetune.tables.reset()
    yield
    fusetune.tables.reset()


POSTGRES_ENV = "FUSETUNE_TEST_POSTGRES"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite database, for tests about something else than the storage."""
    return f"sqlite:///{tmp_path}/ft.db"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of each backend, as a URL in the form users give it.

    sqlite: a file in the test's directory. postgres: a database made for this test on the
    server of $FUSETUNE_TEST_POSTGRES (a URL whose role may create databases, e.g.
    postgresql://postgres@127.0.0.1:5432/postgres; `.ci/run` starts such a server) and dropped
    after it; skipped when that variable is not set."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/ft.db"
        return
    base = os.environ.get(POSTGRES_ENV)
    if not base:
        pytest.skip(f"PostgreSQL tests need {POSTGRES_ENV}=postgresql://USER@HOST:PORT/DB "
                    "(a role that may create databases); it is not set")
    yield from _postgres_database(base)


def _postgres_database(base: str) -> Iterator[str]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    from fusetune.db.store import normalize_url

    name = f"ft_test_{uuid.uuid4().hex[:16]}"
    admin = create_engine(normalize_url(base), isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:  # FORCE: the test's own engines may still hold sessions
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
