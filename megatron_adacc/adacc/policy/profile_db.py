"""The profile database: one SQLite file of layer profiles keyed by device and model signature.

A second run with the same device and signature reuses the stored profile instead of profiling again. The
path comes from ``--adacc-profile-db``, else ``$ADACC_PROFILE_DB``, else
``~/.cache/megatron-adacc/profile.sqlite``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from megatron_adacc.adacc.policy.profile import PROFILE_VERSION, LayerProfile
from megatron_adacc.adacc.policy.signature import signature_key
from megatron_adacc.core.errors import AdaccError

ENV_VAR = "ADACC_PROFILE_DB"
DEFAULT_PATH = Path("~/.cache/megatron-adacc/profile.sqlite")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS profiles (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    device TEXT NOT NULL,
    signature_key TEXT NOT NULL,
    signature TEXT NOT NULL,
    source TEXT NOT NULL,
    created_at REAL NOT NULL,
    payload TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS profiles_by_key ON profiles (device, signature_key, created_at);
CREATE TABLE IF NOT EXISTS process_baselines (
    profile_id INTEGER NOT NULL REFERENCES profiles (id),
    run_key TEXT NOT NULL,
    baseline_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (profile_id, run_key)
);
"""


def default_db_path(cli_value: str | os.PathLike | None = None) -> Path:
    """The database path: the flag, then ``$ADACC_PROFILE_DB``, then the per-user cache."""
    value = cli_value or os.environ.get(ENV_VAR) or DEFAULT_PATH
    return Path(value).expanduser()


class ProfileDBError(AdaccError, RuntimeError):
    """The profile database cannot be opened or read."""


class ProfileDB:
    """Stores and finds :class:`LayerProfile` records. Each call opens its own connection (safe across
    processes; SQLite serializes writers)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = default_db_path(path)
        if self.path.is_dir():
            raise ProfileDBError(f"the profile database {self.path} is a folder; name a file with "
                                 f"--adacc-profile-db or ${ENV_VAR}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file where a folder of the path should be
            raise ProfileDBError(f"the profile database {self.path} cannot be created ({e.strerror}: "
                                 f"{e.filename}); name another with --adacc-profile-db or ${ENV_VAR}") from None
        try:
            with closing(self._connect()) as con, con:
                con.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:  # "file is not a database": damaged, or another file by that name
            raise ProfileDBError(f"the profile database {self.path} cannot be used ({e}). It is only a cache of "
                                 "measurements: move it aside or delete it, or choose another with "
                                 f"--adacc-profile-db or ${ENV_VAR}") from None

    @classmethod
    def existing(cls, path: str | os.PathLike | None) -> ProfileDB | None:
        """The profile database at ``path`` if there is one, creating and changing nothing; else None.

        For paths that come from inputs (a policy file's ``profile.db``): an input names what to read, never
        where to write, so a missing file, a folder or a file that is not a profile database is not touched.
        """
        if not path or not Path(path).expanduser().is_file():
            return None
        found = Path(path).expanduser()
        try:
            with closing(sqlite3.connect(f"{found.resolve().as_uri()}?mode=ro", uri=True)) as con:
                con.execute("SELECT id FROM profiles LIMIT 1")
        except sqlite3.Error:
            return None
        db = cls.__new__(cls)
        db.path = found
        return db

    @classmethod
    def referenced(cls, ref: dict[str, Any] | None) -> LayerProfile | None:
        """The profile a policy file's ``profile`` reference points at, read without creating or changing
        anything (see :meth:`existing`); None when it is not there."""
        ref = ref or {}
        db = cls.existing(ref.get("db"))
        try:
            return db.get_by_id(int(ref["id"])) if db is not None else None
        except (KeyError, TypeError, ValueError):
            return None

    def _connect(self) -> sqlite3.Connection:
        try:
            return sqlite3.connect(str(self.path), timeout=30)
        except sqlite3.Error as e:
            raise ProfileDBError(f"cannot open the profile database {self.path}: {e} "
                                 f"(choose another with --adacc-profile-db or ${ENV_VAR})") from None

    def put(self, profile: LayerProfile) -> int:
        """Store ``profile``; returns its id."""
        with closing(self._connect()) as con, con:
            cur = con.execute(
                "INSERT INTO profiles (device, signature_key, signature, source, created_at, payload) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (profile.device, signature_key(profile.signature), json.dumps(profile.signature, sort_keys=True),
                 profile.source, profile.created_at, json.dumps(profile.to_json())))
            return int(cur.lastrowid)

    def get(self, device: str, signature: dict[str, Any]) -> tuple[int, LayerProfile] | None:
        """The newest profile for this device and signature, with its id, or None (also when the newest was
        written by an older profile format, so that the caller profiles again)."""
        with closing(self._connect()) as con:
            row = con.execute(
                "SELECT id, payload FROM profiles WHERE device = ? AND signature_key = ? "
                "ORDER BY created_at DESC, id DESC LIMIT 1",
                (device, signature_key(signature))).fetchone()
        if row is None:
            return None
        payload = json.loads(row[1])
        if payload.get("profile_version") != PROFILE_VERSION:
            return None
        return int(row[0]), LayerProfile.from_json(payload)

    def get_by_id(self, profile_id: int) -> LayerProfile:
        with closing(self._connect()) as con:
            row = con.execute("SELECT payload FROM profiles WHERE id = ?", (profile_id,)).fetchone()
        if row is None:
            raise KeyError(f"no profile with id {profile_id} in {self.path}")
        return LayerProfile.from_json(json.loads(row[0]))

    def list(self) -> list[dict[str, Any]]:
        """One summary row per stored profile (id, device, signature, source, created_at)."""
        with closing(self._connect()) as con:
            rows = con.execute("SELECT id, device, signature, source, created_at FROM profiles ORDER BY id").fetchall()
        return [{"id": r[0], "device": r[1], "signature": json.loads(r[2]), "source": r[3], "created_at": r[4]}
                for r in rows]

    def put_baseline(self, profile_id: int, run_key: str, baseline_bytes: int) -> None:
        """Store the measured process memory outside the cost model for runs of ``run_key`` on this profile."""
        with closing(self._connect()) as con, con:
            con.execute("INSERT OR REPLACE INTO process_baselines VALUES (?, ?, ?, ?)",
                        (profile_id, run_key, int(baseline_bytes), time.time()))

    def get_baseline(self, profile_id: int, run_key: str) -> int | None:
        """What :meth:`put_baseline` stored, or None."""
        with closing(self._connect()) as con:
            row = con.execute("SELECT baseline_bytes FROM process_baselines WHERE profile_id = ? AND run_key = ?",
                              (profile_id, run_key)).fetchone()
        return None if row is None else int(row[0])

    def reference(self, profile_id: int, profile: LayerProfile) -> dict[str, Any]:
        """What a policy file stores to point at this profile."""
        return {"db": str(self.path), "id": profile_id, "device": profile.device, "source": profile.source,
                "created_at": profile.created_at}
