"""The same dedup and rollups in DuckDB, from the same landing files: the second engine.

Written from the rules in pipeline/transforms.py's docstring, in plain SQL, and
sharing no code with the Spark job. ``compare`` checks Spark's Parquet tables
against these, row for row and column for column, both directions (EXCEPT ALL).
"""

from __future__ import annotations

from pathlib import Path

import duckdb

COLUMNS = (
    "{id: 'VARCHAR', origin: 'VARCHAR', sensor: 'VARCHAR', ts: 'VARCHAR', value: 'DOUBLE', "
    "unit: 'VARCHAR', flags: 'VARCHAR[]', gateway: 'VARCHAR', received: 'VARCHAR'}"
)
ROLLUP = """
    count(value)::BIGINT AS count, min(value) AS min, max(value) AS max,
    sum(value::DECIMAL(18,3))::DECIMAL(38,3) AS sum,
    sum(value::DECIMAL(18,3))::DOUBLE / count(value) AS mean,
    arg_min(value, {'t': ts, 'i': id}) AS first_value, min(ts) AS first_ts,
    arg_max(value, {'t': ts, 'i': id}) AS last_value, max(ts) AS last_ts,
    max(unit) AS unit
"""


def build(landing: Path, con: duckdb.DuckDBPyConnection | None = None) -> duckdb.DuckDBPyConnection:
    con = con or duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    files = f"{landing}/date=*/*.jsonl"
    con.execute(
        f"""
        CREATE OR REPLACE TABLE lines AS SELECT * FROM read_json(
            '{files}', format = 'newline_delimited', columns = {COLUMNS},
            ignore_errors = true)
        """
    )
    con.execute(
        """
        CREATE OR REPLACE TABLE valid AS
        SELECT id, origin, sensor, t AS ts, value, unit, flags, gateway, r AS received
        FROM (SELECT *, try_strptime(ts, '%Y-%m-%dT%H:%M:%S.%gZ') AS t,
                        try_strptime(received, '%Y-%m-%dT%H:%M:%S.%gZ') AS r FROM lines)
        WHERE id IS NOT NULL AND id <> '' AND origin IS NOT NULL AND sensor IS NOT NULL
          AND t IS NOT NULL AND NOT coalesce(isnan(value) OR isinf(value), false)
          AND NOT coalesce(abs(value) >= 1e15, false)
          AND t >= TIMESTAMP '2000-01-01'
          AND NOT (r IS NOT NULL AND t > r + INTERVAL 1 DAY)
        """
    )
    con.execute(
        """
        CREATE OR REPLACE TABLE readings AS
        SELECT * FROM valid
        QUALIFY row_number() OVER (
            PARTITION BY id
            ORDER BY coalesce(received, TIMESTAMP '9999-12-31'), coalesce(gateway, '')) = 1
        """
    )
    for name, unit in (("rollup_1m", "minute"), ("rollup_1h", "hour"), ("rollup_1d", "day")):
        con.execute(
            f"""
            CREATE OR REPLACE TABLE {name} AS
            SELECT origin, sensor, date_trunc('{unit}', ts) AS window_start, {ROLLUP}
            FROM readings WHERE value IS NOT NULL GROUP BY ALL
            """
        )
    return con


def spark_table(con: duckdb.DuckDBPyConnection, warehouse: Path, table: str, cols: str) -> str:
    """SQL for one of Spark's tables as DuckDB reads its Parquet (timestamps to UTC wall time)."""
    path = f"{warehouse}/{table}/**/*.parquet"
    return f"SELECT {cols} FROM read_parquet('{path}', hive_partitioning = true)"


READINGS_COLS = (
    "id, origin, sensor, ts::TIMESTAMP AS ts, value, unit, flags, gateway, "
    "received::TIMESTAMP AS received"
)
ROLLUP_COLS = (
    "origin, sensor, window_start::TIMESTAMP AS window_start, count, min, max, sum, mean, "
    "first_value, first_ts::TIMESTAMP AS first_ts, last_value, last_ts::TIMESTAMP AS last_ts, "
    "unit"
)


def compare(con: duckdb.DuckDBPyConnection, warehouse: Path) -> dict[str, tuple[int, int, int]]:
    """Per table: (rows, rows only in Spark, rows only in DuckDB)."""
    out = {}
    for table, cols in (
        ("readings", READINGS_COLS),
        ("rollup_1m", ROLLUP_COLS),
        ("rollup_1h", ROLLUP_COLS),
        ("rollup_1d", ROLLUP_COLS),
    ):
        spark = spark_table(con, warehouse, table, cols)
        mine = f"SELECT {cols.replace('::TIMESTAMP', '')} FROM {table}"
        only_spark = con.execute(f"SELECT count(*) FROM ({spark} EXCEPT ALL {mine})").fetchone()
        only_duck = con.execute(f"SELECT count(*) FROM ({mine} EXCEPT ALL {spark})").fetchone()
        rows = con.execute(f"SELECT count(*) FROM {table}").fetchone()
        out[table] = (rows[0], only_spark[0], only_duck[0])  # type: ignore[index]
    return out


def quality(con: duckdb.DuckDBPyConnection, late_after_s: int) -> dict[tuple[str, str], tuple]:
    """Per (origin, sensor): (readings kept, duplicates removed, late, clock-flagged)."""
    rows = con.execute(
        f"""
        SELECT v.origin, v.sensor, k.kept, v.n - k.kept, k.late, k.clock
        FROM (SELECT origin, sensor, count(*) AS n FROM valid GROUP BY ALL) v
        JOIN (SELECT origin, sensor, count(*) AS kept,
                     count(*) FILTER (WHERE epoch(received) - epoch(ts) > {late_after_s}) AS late,
                     count(*) FILTER (WHERE list_contains(flags, 'clock_unsynced')
                                         OR list_contains(flags, 'clock_corrected')) AS clock
              FROM readings GROUP BY ALL) k USING (origin, sensor)
        """
    ).fetchall()
    return {(o, s): tuple(rest) for o, s, *rest in rows}
