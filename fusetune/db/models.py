"""SQLAlchemy 2.0 models of fusetune's tables. Optuna keeps its own tables in the same database."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


# The activation mode of a point (Point.activations) is stored in its `weights` column after
# this separator ("fp8-e4m3+act=fp8"): the column is part of ft_points' unique key in every
# database made so far, so the mode keys points apart there without changing the constraint.
ACTIVATIONS_SEP = "+act="


def numerics_column(weights: str, activations: str) -> str:
    """What ft_points.weights holds for a point of these weights and activation mode."""
    return f"{weights}{ACTIVATIONS_SEP}{activations}" if activations else weights


def split_numerics(column: str) -> tuple[str, str]:
    """(weights, activations) of an ft_points.weights value (see numerics_column)."""
    weights, _, activations = column.partition(ACTIVATIONS_SEP)
    return weights, activations


class PointRow(Base):
    """A tuning point, keyed also by what makes results stale (kernel source, Triton, torch)."""

    __tablename__ = "ft_points"
    __table_args__ = (
        UniqueConstraint("gpu", "kernel", "dims", "batch", "seq", "dtype", "weights", "backend",
                         "kernel_hash", "triton_version", "torch_version", name="uq_ft_point"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpu: Mapped[str] = mapped_column(String(64))
    kernel: Mapped[str] = mapped_column(String(64))
    dims: Mapped[str] = mapped_column(String(255))  # sorted JSON, e.g. {"dim":4096}
    batch: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String(16))
    # The weight format, and the activation mode after ACTIVATIONS_SEP (numerics_column).
    weights: Mapped[str] = mapped_column(String(32), default="")
    backend: Mapped[str] = mapped_column(String(16))
    kernel_hash: Mapped[str] = mapped_column(String(32))
    triton_version: Mapped[str] = mapped_column(String(32))
    torch_version: Mapped[str] = mapped_column(String(64))
    study_name: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    results: Mapped[list[ResultRow]] = relationship(back_populates="point")

    @property
    def weight_format(self) -> str:
        """Point.weights: "", "fp8-e4m3" or "fp8-e5m2"."""
        return split_numerics(self.weights)[0]

    @property
    def activations(self) -> str:
        """Point.activations: "" or "fp8"."""
        return split_numerics(self.weights)[1]


class ResultRow(Base):
    """One evaluated config at one point: its status, reason and timings."""

    __tablename__ = "ft_results"
    __table_args__ = (UniqueConstraint("point_id", "config_key", name="uq_ft_result"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    point_id: Mapped[int] = mapped_column(ForeignKey("ft_points.id", ondelete="CASCADE"),
                                          index=True)
    config_key: Mapped[str] = mapped_column(String(512))
    config: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(Text, default="")
    time_us: Mapped[float | None] = mapped_column(Float, nullable=True)
    p20_us: Mapped[float | None] = mapped_column(Float, nullable=True)
    p80_us: Mapped[float | None] = mapped_column(Float, nullable=True)
    rel_err: Mapped[float | None] = mapped_column(Float, nullable=True)
    compile_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    trial_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The device that evaluated it ("cuda:1", "cpu"; None: pruned, never run). Added after the
    # first release: see store._ADDED_COLUMNS.
    device: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # The config's compiled kernels, as the CUDA driver reports them (None: unknown, e.g. under
    # the interpreter or for a config that failed before loading): registers per thread and
    # shared memory per program of the kernel that uses the most, spilled registers of all its
    # kernels together. Added after the first release: see store._ADDED_COLUMNS.
    n_regs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    n_spills: Mapped[int | None] = mapped_column(Integer, nullable=True)
    smem_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    point: Mapped[PointRow] = relationship(back_populates="results")


class WinnerRow(Base):
    """The chosen config of a point, re-timed beside the default heuristic's config."""

    __tablename__ = "ft_winners"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    point_id: Mapped[int] = mapped_column(ForeignKey("ft_points.id", ondelete="CASCADE"),
                                          unique=True)
    config: Mapped[dict] = mapped_column(JSON)
    time_us: Mapped[float] = mapped_column(Float)
    default_config: Mapped[dict] = mapped_column(JSON)
    default_us: Mapped[float | None] = mapped_column(Float, nullable=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    flops: Mapped[int] = mapped_column(BigInteger)
    n_evaluated: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow,
                                                 onupdate=utcnow)

    point: Mapped[PointRow] = relationship()


class RunningRow(Base):
    """A trial being evaluated right now, with its config, its process and a heartbeat.

    Lets a search that starts on a point tell a trial left RUNNING by a dead process (stale
    heartbeat, or a dead pid on this host) from one that another live search is running. The
    unique (point, config) index is what stops two searches, on one host or several, from
    evaluating one config at the same time: the second insert fails, whatever the timing."""

    __tablename__ = "ft_running"
    __table_args__ = (
        UniqueConstraint("point_id", "trial_number", name="uq_ft_running"),
        # An index, not a constraint: databases made before this column get it with
        # CREATE UNIQUE INDEX (SQLite cannot add a constraint to an existing table).
        Index("uq_ft_running_config", "point_id", "config_key", unique=True),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    point_id: Mapped[int] = mapped_column(ForeignKey("ft_points.id", ondelete="CASCADE"),
                                          index=True)
    trial_number: Mapped[int] = mapped_column(Integer)
    config_key: Mapped[str | None] = mapped_column(String(512), nullable=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
