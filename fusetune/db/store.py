"""Engine and sessions; recording results and winners; the queries export and show need."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Connection,
    create_engine,
    delete,
    event,
    func,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from fusetune.db.models import (
    Base,
    PointRow,
    ResultRow,
    RunningRow,
    WinnerRow,
    numerics_column,
    utcnow,
)

DEFAULT_DB = "sqlite:///fusetune.db"
POSTGRES_DRIVER = "postgresql+psycopg"  # psycopg 3: pip install 'fusetune[postgres]'
# Any fixed 64-bit number: the PostgreSQL advisory lock that table creation holds.
SCHEMA_LOCK_KEY = 0x66757365_74756E65  # "fusetune"


def dims_json(dims: Mapping[str, int]) -> str:
    """A point's dims as ft_points stores them: JSON with sorted keys, no spaces."""
    return json.dumps(dict(sorted(dims.items())), separators=(",", ":"))


class StoreError(RuntimeError):
    """A database URL that cannot be used (unknown form, missing driver, a SQLite file that
    must exist and does not); the message says why."""


@dataclass(frozen=True)
class PointKey:
    """Everything that identifies a stored point (see ft_points' unique constraint)."""

    gpu: str
    kernel: str
    dims: Mapping[str, int]
    batch: int
    seq: int
    dtype: str
    weights: str
    backend: str
    kernel_hash: str
    triton_version: str
    torch_version: str
    activations: str = ""

    @property
    def dims_json(self) -> str:
        return dims_json(self.dims)

    @property
    def study_name(self) -> str:
        dims = ",".join(f"{k}={v}" for k, v in sorted(self.dims.items()))
        w = f"/w={self.weights}" if self.weights else ""
        w += f"/a={self.activations}" if self.activations else ""
        return (f"fusetune/{self.gpu}/{self.kernel}/{dims}/b={self.batch}/s={self.seq}/"
                f"{self.dtype}{w}/{self.backend}/k={self.kernel_hash}/"
                f"triton={self.triton_version}/torch={self.torch_version}")


def safe_url(url: str) -> str:
    """`url` with its password masked, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def normalize_url(url: str) -> str:
    """The SQLAlchemy URL to connect with: `postgresql://` (and `postgres://`) use psycopg 3.

    The one place where a URL without a driver gets one; every engine (fusetune's tables and
    Optuna's storage) is made from its result."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            url = f"{POSTGRES_DRIVER}://{url[len(scheme):]}"
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreError(f"{url!r} is not a database URL; expected e.g. sqlite:///fusetune.db "
                         "or postgresql://user@host/dbname") from None
    if parsed.drivername == POSTGRES_DRIVER:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise StoreError(f"{safe_url(url)}: PostgreSQL needs the psycopg driver; install it "
                             "with pip install 'fusetune[postgres]'") from None
    return url


def is_postgres(url: str) -> bool:
    return normalize_url(url).startswith("postgresql")


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for `url`; SQLite gets WAL and a busy timeout so several writers can wait."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 60}, **kwargs)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, **kwargs)


@contextmanager
def schema_lock(url: str) -> Iterator[None]:
    """Held while tables are created in the database at `url`, one process at a time.

    On PostgreSQL, two processes creating the same table at once make one of them fail
    (duplicate key in pg_type): an advisory lock on its own connection serializes them, for
    fusetune's tables and Optuna's alike. SQLite needs none (its writers queue; the rare race
    between checking for a table and creating it is retried by the callers)."""
    if not is_postgres(url):
        yield
        return
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": SCHEMA_LOCK_KEY})
                conn.commit()
    finally:
        engine.dispose()


# Columns added to the models after their table was first made: (table, column, SQL type), all
# nullable. Databases made before get them from `_upgrade`.
_ADDED_COLUMNS = (
    ("ft_running", "config_key", "VARCHAR(512)"),
    ("ft_results", "device", "VARCHAR(32)"),
    ("ft_results", "n_regs", "INTEGER"),
    ("ft_results", "n_spills", "INTEGER"),
    ("ft_results", "smem_bytes", "INTEGER"),
)


def _upgrade(conn: Connection) -> None:
    """Brings tables made by an earlier fusetune up to the models (create_all adds only the
    missing tables): the columns of `_ADDED_COLUMNS` and ft_running's unique config index."""
    inspector = inspect(conn)
    for table, column, sql_type in _ADDED_COLUMNS:
        if column not in {c["name"] for c in inspector.get_columns(table)}:
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}"))
    for index in RunningRow.__table__.indexes:
        index.create(conn, checkfirst=True)


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite database URL; None for other databases and in-memory SQLite."""
    parsed = make_url(normalize_url(url))
    if parsed.get_backend_name() != "sqlite":
        return None
    name = parsed.database or ""
    if name in ("", ":memory:") or parsed.query.get("mode") == "memory":
        return None
    if name.startswith("file:"):  # a URI filename (uri=true): its path, without its query
        name = name[len("file:"):].split("?", 1)[0]
    return Path(name)


class Store:
    """fusetune's tables in the database at `url`, created if missing unless `create` is False
    (then a SQLite file that does not exist is a StoreError naming it, rather than a new,
    empty database: a mistyped path must not read as a database without results)."""

    def __init__(self, url: str = DEFAULT_DB, *, create: bool = True) -> None:
        path = None if create else sqlite_file(url)
        if path is not None and not path.is_file():
            raise StoreError(f"no database at {path}: the file does not exist (`fusetune "
                             "search` creates the database it is given with --db)")
        self.url = url
        self.engine = make_engine(url)
        with schema_lock(url):
            for attempt in range(5):
                try:
                    with self.engine.begin() as conn:
                        Base.metadata.create_all(conn)
                        _upgrade(conn)
                    break
                except (OperationalError, ProgrammingError, IntegrityError):
                    # SQLite: another process created a table (or added the column) between
                    # this one's check and its create; the next try sees it.
                    if attempt == 4:
                        raise
                    time.sleep(0.2 * (attempt + 1))
        self._session = sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> Session:
        return self._session()

    def point_id(self, key: PointKey) -> int:
        """Id of the point row for `key`, created if missing (safe against a concurrent insert)."""
        cols = dict(gpu=key.gpu, kernel=key.kernel, dims=key.dims_json, batch=key.batch,
                    seq=key.seq, dtype=key.dtype,
                    weights=numerics_column(key.weights, key.activations), backend=key.backend,
                    kernel_hash=key.kernel_hash, triton_version=key.triton_version,
                    torch_version=key.torch_version)
        for _ in range(2):
            with self.session() as s:
                found = s.scalar(select(PointRow.id).filter_by(**cols))
                if found is not None:
                    return found
                row = PointRow(study_name=key.study_name, **cols)
                s.add(row)
                try:
                    s.commit()
                    return row.id
                except IntegrityError:  # another process inserted it first: read theirs
                    s.rollback()
        raise AssertionError("point row neither found nor inserted")

    def results(self, point_id: int) -> dict[str, ResultRow]:
        """Stored results of a point by config key."""
        with self.session() as s:
            rows = s.scalars(select(ResultRow).where(ResultRow.point_id == point_id)).all()
            return {r.config_key: r for r in rows}

    def result(self, point_id: int, config_key: str) -> ResultRow | None:
        """The stored result of one config at a point, if there is one."""
        with self.session() as s:
            return s.scalar(select(ResultRow).filter_by(point_id=point_id,
                                                        config_key=config_key))

    def record(self, point_id: int, config_key: str, config: Mapping[str, int], status: str,
               reason: str = "", *, time_us: float | None = None, p20_us: float | None = None,
               p80_us: float | None = None, rel_err: float | None = None,
               compile_s: float | None = None, trial_number: int | None = None,
               device: str | None = None, n_regs: int | None = None,
               n_spills: int | None = None, smem_bytes: int | None = None) -> ResultRow:
        """Stores one result; if that config already has one, keeps and returns the stored one.
        `device`: where it was evaluated (None for a config pruned without running). `n_regs`,
        `n_spills`, `smem_bytes`: of its compiled kernels (see ResultRow), where known.

        Two searches recording the same config at once: the unique (point, config) constraint
        lets one insert through, the other reads that row back."""
        row = ResultRow(point_id=point_id, config_key=config_key, config=dict(config),
                        # PostgreSQL's text cannot hold NUL (a crashed process's output may)
                        status=status, reason=reason.replace("\x00", ""), time_us=time_us,
                        p20_us=p20_us, p80_us=p80_us, rel_err=rel_err, compile_s=compile_s,
                        trial_number=trial_number, device=device, n_regs=n_regs,
                        n_spills=n_spills, smem_bytes=smem_bytes)
        with self.session() as s:
            s.add(row)
            try:
                s.commit()
                return row
            except IntegrityError:
                s.rollback()
                existing = s.scalar(select(ResultRow).filter_by(point_id=point_id,
                                                                config_key=config_key))
                assert existing is not None
                return existing

    def winner(self, point_id: int) -> WinnerRow | None:
        """The stored winner of a point, if it has one."""
        with self.session() as s:
            return s.scalar(select(WinnerRow).where(WinnerRow.point_id == point_id))

    def set_winner(self, point_id: int, config: Mapping[str, int], time_us: float,
                   default_config: Mapping[str, int], default_us: float | None, nbytes: int,
                   flops: int, n_evaluated: int, *, replaces: WinnerRow | None = None
                   ) -> WinnerRow:
        """Stores the winner of a point in place of `replaces`, the winner the caller read
        before re-timing its pick beside it (None: the point had none). Returns the winner
        stored after the call, which the caller reports.

        If another winner was stored since `replaces` was read (a search finishing the same
        point at the same time), that one stays: the two picks were re-timed in different
        sessions, so neither measured the other, and the first one stored may already have been
        shown. Both finishers then report one winner, the one exported. The check is one
        statement (an UPDATE of the row only while it is still `replaces`, or an INSERT that
        the unique point_id refuses where another got in first), atomic on SQLite and
        PostgreSQL alike."""
        values = dict(config=dict(config), time_us=time_us, default_config=dict(default_config),
                      default_us=default_us, bytes=nbytes, flops=flops,
                      n_evaluated=n_evaluated, updated_at=utcnow())
        with self.session() as s:
            if replaces is not None:
                # The row as it was read: an update by anyone since changes updated_at.
                s.execute(update(WinnerRow)
                          .where(WinnerRow.point_id == point_id, WinnerRow.id == replaces.id,
                                 WinnerRow.updated_at == replaces.updated_at)
                          .values(**values))
                s.commit()
            else:
                s.add(WinnerRow(point_id=point_id, **values))
                try:
                    s.commit()
                except IntegrityError:  # another search stored a winner first: it stays
                    s.rollback()
        stored = self.winner(point_id)
        if stored is None:  # `replaces` is gone with its row: nothing to keep
            return self.set_winner(point_id, config, time_us, default_config, default_us,
                                   nbytes, flops, n_evaluated)
        self.checkpoint()
        return stored

    def checkpoint(self) -> None:
        """SQLite: what its write-ahead log holds copied into the database file (PASSIVE: not
        waiting for readers; what it cannot copy now goes at a later one). Called as each point
        gets its winner, so that a search killed later leaves every finished point in the file
        itself: a copy of the file without its -wal beside it (to another host, say) does not
        silently lack them. PostgreSQL: nothing to do."""
        if self.engine.dialect.name != "sqlite":
            return
        with self.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")

    def winners(self, gpu: str | None = None, kernel: str | None = None
                ) -> list[tuple[PointRow, WinnerRow]]:
        """(point, winner) pairs, newest first, optionally for one GPU and/or kernel."""
        q = select(PointRow, WinnerRow).join(WinnerRow, WinnerRow.point_id == PointRow.id)
        if gpu is not None:
            q = q.where(PointRow.gpu == gpu)
        if kernel is not None:
            q = q.where(PointRow.kernel == kernel)
        q = q.order_by(WinnerRow.updated_at.desc())
        with self.session() as s:
            return [(p, w) for p, w in s.execute(q).all()]

    def gpus(self) -> list[str]:
        """The GPUs the stored points were measured on, by name."""
        with self.session() as s:
            return sorted(s.scalars(select(PointRow.gpu).distinct()).all())

    def points(self, kernel: str | None = None) -> list[PointRow]:
        """The stored points in the order they were made, optionally of one kernel."""
        q = select(PointRow).order_by(PointRow.id)
        if kernel is not None:
            q = q.where(PointRow.kernel == kernel)
        with self.session() as s:
            return list(s.scalars(q).all())

    def points_of_shape(self, gpu: str, kernel: str, dims: Mapping[str, int], batch: int,
                        seq: int, dtype: str, weights: str, backend: str | None = None,
                        activations: str = "") -> list[tuple[PointRow, int]]:
        """The stored points of one shape of `kernel` on `gpu`, whatever kernel version, Triton
        and torch they were measured with (and of one backend if given), each with its number
        of stored results: the most results first, then the newest."""
        n = func.count(ResultRow.id)
        q = (select(PointRow, n).outerjoin(ResultRow, ResultRow.point_id == PointRow.id)
             .where(PointRow.gpu == gpu, PointRow.kernel == kernel,
                    PointRow.dims == dims_json(dims), PointRow.batch == batch,
                    PointRow.seq == seq, PointRow.dtype == dtype,
                    PointRow.weights == numerics_column(weights, activations))
             .group_by(PointRow.id).order_by(n.desc(), PointRow.id.desc()))
        if backend is not None:
            q = q.where(PointRow.backend == backend)
        with self.session() as s:
            return [(row, count) for row, count in s.execute(q).all()]

    # -- trials being evaluated -----------------------------------------------------------------

    def claim_running(self, point_id: int, trial_number: int, host: str, pid: int,
                      config_key: str | None = None) -> int | None:
        """Records that this process evaluates the trial (and its config) now; returns the row
        id to beat, or None when a row for that trial or config is there already (another
        search's claim: see `claim_of`)."""
        with self.session() as s:
            row = RunningRow(point_id=point_id, trial_number=trial_number, host=host, pid=pid,
                             config_key=config_key)
            s.add(row)
            try:
                s.commit()
            except IntegrityError:
                s.rollback()
                return None
            return row.id

    def claim_of(self, point_id: int, trial_number: int, config_key: str | None
                 ) -> RunningRow | None:
        """The claim on that trial, or on that config, of a point (None: there is none)."""
        cond = RunningRow.trial_number == trial_number
        if config_key is not None:
            cond = cond | (RunningRow.config_key == config_key)
        with self.session() as s:
            return s.scalars(select(RunningRow).where(RunningRow.point_id == point_id, cond)
                             .order_by(RunningRow.id)).first()

    # beat and release are single statements on the claim's id: another process may have
    # removed the claim in between (a stale claim failed by a resuming search), which is fine.
    def beat(self, running_id: int) -> None:
        with self.session() as s:
            s.execute(update(RunningRow).where(RunningRow.id == running_id)
                      .values(heartbeat_at=utcnow()))
            s.commit()

    def release(self, running_id: int) -> None:
        with self.session() as s:
            s.execute(delete(RunningRow).where(RunningRow.id == running_id))
            s.commit()

    def running(self, point_id: int) -> dict[int, RunningRow]:
        """The claimed trials of a point by trial number."""
        with self.session() as s:
            rows = s.scalars(select(RunningRow).where(RunningRow.point_id == point_id)).all()
            return {r.trial_number: r for r in rows}

    def point(self, point_id: int) -> PointRow | None:
        with self.session() as s:
            return s.get(PointRow, point_id)

    def top_results(self, point_id: int, n: int) -> list[ResultRow]:
        """The `n` fastest correct configs of a point."""
        q = (select(ResultRow).where(ResultRow.point_id == point_id, ResultRow.status == "ok")
             .order_by(ResultRow.time_us).limit(n))
        with self.session() as s:
            return list(s.scalars(q).all())

    def failure_reasons(self, point_id: int) -> list[tuple[str, str, int]]:
        """(status, reason, how many configs) of a point's failed configs, most frequent first.

        Reasons that differ only in numbers (register counts, sizes) are grouped together."""
        groups: Counter[tuple[str, str]] = Counter()
        for r in self.results(point_id).values():
            if r.status != "ok":
                groups[(r.status, re.sub(r"\d+", "N", r.reason or ""))] += 1
        return [(st, reason, n) for (st, reason), n in groups.most_common()]

    def status_counts(self, point_id: int) -> Counter[str]:
        return Counter(r.status for r in self.results(point_id).values())
