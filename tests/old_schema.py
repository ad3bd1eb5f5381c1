"""Tables as earlier versions of fusetune made them, for the tests that upgrade them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)
from sqlalchemy import UniqueConstraint as Unique

from fusetune.db.models import Base
from fusetune.db.store import make_engine


def create_old_table(db_url: str, name: str, *columns: Any) -> None:
    """ft_points as now, and table `name` as an earlier version made it: an id, a point_id
    referencing ft_points, then `columns` (Columns and constraints)."""
    engine = make_engine(db_url)
    Base.metadata.create_all(engine, tables=[Base.metadata.tables["ft_points"]])
    old = MetaData()
    Table("ft_points", old, Column("id", Integer, primary_key=True))
    Table(name, old, Column("id", Integer, primary_key=True),
          Column("point_id", ForeignKey("ft_points.id", ondelete="CASCADE"), index=True),
          *columns)
    old.create_all(engine, tables=[old.tables[name]])
    engine.dispose()


def create_first_results_table(db_url: str) -> None:
    """ft_results as it was before it stored the device and the compiled kernels' figures
    (registers, spills, shared memory)."""
    create_old_table(
        db_url, "ft_results",
        Column("config_key", String(512)), Column("config", JSON), Column("status", String(32)),
        Column("reason", Text), Column("time_us", Float), Column("p20_us", Float),
        Column("p80_us", Float), Column("rel_err", Float), Column("compile_s", Float),
        Column("trial_number", Integer), Column("created_at", DateTime(timezone=True)),
        Unique("point_id", "config_key", name="uq_ft_result"))
