"""The same dedup and rollups in DuckDB, from the same landing files: the second engine.

Written from the rules in pipeline/transforms.py's docstring, in plain SQL, and
sharing no code with the Spark job. ``compare`` checks Spark's Parquet tables
against these, row for row and column for column, both directions (EXCEPT ALL).

The dedup here is the rule stated once over all the landing files, with no
notion of batches or runs: per id, the copy received first (then the smallest
gateway name) is the reading, whatever its ``ts``. Spark reaches the same
table one batch at a time through its seen-id index; any difference in how
the files were split into runs must not show.

``quarantine`` is built from the raw lines (read as text, so a line that is not
JSON is still a row) with the reasons in the job's order; Spark's JSON reader
takes ``NaN`` and ``±Infinity`` as numbers, so those tokens are read as such.
``quality`` is compared summed over batches: what the per-batch table adds up to.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

COLUMNS = (
    "{id: 'VARCHAR', origin: 'VARCHAR', sensor: 'VARCHAR', ts: 'VARCHAR', value: 'DOUBLE', "
    "unit: 'VARCHAR', flags: 'VARCHAR[]', kind: 'VARCHAR', gateway: 'VARCHAR', "
    "received: 'VARCHAR'}"
)
ROLLUP = """
    count(value)::BIGINT AS count, min(value) AS min, max(value) AS max,
    sum(value::DECIMAL(18,3))::DECIMAL(38,3) AS sum,
    sum(value::DECIMAL(18,3))::DOUBLE / count(value) AS mean,
    arg_min(value, {'t': ts, 'i': id}) AS first_value, min(ts) AS first_ts,
    arg_max(value, {'t': ts, 'i': id}) AS last_value, max(ts) AS last_ts,
    max(unit) AS unit, max(kind) AS kind
"""


TS = "'%Y-%m-%dT%H:%M:%S.%gZ'"
NO_DELIM = "\x01"  # read each line whole, as one text column


def build(
    landing: Path, con: duckdb.DuckDBPyConnection | None = None, *, quarantine: bool = True
) -> duckdb.DuckDBPyConnection:
    """Every table from the landing files (``quarantine=False``: all but quarantine)."""
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
        SELECT id, origin, sensor, t AS ts, value, unit, flags, k AS kind, gateway,
               r AS received
        FROM (SELECT *, try_strptime(ts, '%Y-%m-%dT%H:%M:%S.%gZ') AS t,
                        try_strptime(received, '%Y-%m-%dT%H:%M:%S.%gZ') AS r,
                        coalesce(kind, 'gauge') AS k FROM lines)
        WHERE id IS NOT NULL AND id <> '' AND origin IS NOT NULL AND sensor IS NOT NULL
          AND t IS NOT NULL AND NOT coalesce(isnan(value) OR isinf(value), false)
          AND NOT coalesce(abs(value) >= 1e15, false)
          AND k IN ('gauge', 'counter', 'total')
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
    if quarantine:
        build_quarantine(landing, con)
    return con


def build_quarantine(landing: Path, con: duckdb.DuckDBPyConnection) -> None:
    """The lines that cannot be kept, with the first reason, from the raw text of every line."""
    files = f"{landing}/date=*/*.jsonl"
    con.execute(
        rf"""
        CREATE OR REPLACE TABLE quarantine AS
        WITH raw AS (
            SELECT regexp_replace(
                       line, '(:\s*)(-?Infinity|NaN)(\s*[,}}])', '\1"\2"\3', 'g') AS j
            FROM read_csv('{files}', columns = {{'line': 'VARCHAR'}}, delim = '{NO_DELIM}',
                          quote = '', escape = '', header = false, auto_detect = false)
            WHERE trim(line) <> ''
        ), fields AS (
            SELECT ok,
                   CASE WHEN ok THEN json_extract_string(j, '$.id') END AS id,
                   CASE WHEN ok THEN json_extract_string(j, '$.origin') END AS origin,
                   CASE WHEN ok THEN json_extract_string(j, '$.sensor') END AS sensor,
                   CASE WHEN ok THEN try_strptime(json_extract_string(j, '$.ts'), {TS}) END AS t,
                   CASE WHEN ok THEN try_strptime(json_extract_string(j, '$.received'), {TS})
                   END AS r,
                   CASE WHEN ok THEN try_cast(json_extract_string(j, '$.value') AS DOUBLE)
                   END AS v,
                   CASE WHEN ok THEN coalesce(json_extract_string(j, '$.kind'), 'gauge')
                   END AS k
            FROM (SELECT j, CASE WHEN json_valid(j) THEN json_type(j) = 'OBJECT' ELSE false
                            END AS ok FROM raw)
        )
        SELECT CASE
                 WHEN NOT ok THEN 'malformed_line'
                 WHEN id IS NULL OR id = '' THEN 'missing_id'
                 WHEN origin IS NULL THEN 'missing_origin'
                 WHEN sensor IS NULL THEN 'missing_sensor'
                 WHEN t IS NULL THEN 'bad_ts'
                 WHEN isnan(v) OR isinf(v) THEN 'value_not_finite'
                 WHEN abs(v) >= 1e15 THEN 'value_out_of_range'
                 WHEN k NOT IN ('gauge', 'counter', 'total') THEN 'bad_kind'
                 WHEN t < TIMESTAMP '2000-01-01' THEN 'ts_before_2000'
                 WHEN r IS NOT NULL AND t > r + INTERVAL 1 DAY THEN 'ts_in_future'
               END AS reason, id, origin, sensor
        FROM fields WHERE reason IS NOT NULL
        """
    )


def spark_table(con: duckdb.DuckDBPyConnection, warehouse: Path, table: str, cols: str) -> str:
    """SQL for one of Spark's tables as DuckDB reads its Parquet (timestamps to UTC wall time)."""
    path = f"{warehouse}/{table}/**/*.parquet"
    return f"SELECT {cols} FROM read_parquet('{path}', hive_partitioning = true)"


READINGS_COLS = (
    "id, origin, sensor, ts::TIMESTAMP AS ts, value, unit, flags, kind, gateway, "
    "received::TIMESTAMP AS received"
)
ROLLUP_COLS = (
    "origin, sensor, window_start::TIMESTAMP AS window_start, count, min, max, sum, mean, "
    "first_value, first_ts::TIMESTAMP AS first_ts, last_value, last_ts::TIMESTAMP AS last_ts, "
    "unit, kind"
)


QUALITY_SQL = """
    SELECT v.origin, v.sensor, v.n AS lines_in, coalesce(k.kept, 0) AS kept,
           v.n - coalesce(k.kept, 0) AS duplicates_removed, coalesce(k.late, 0) AS late,
           coalesce(k.clock, 0) AS clock_flagged
    FROM (SELECT origin, sensor, count(*) AS n FROM valid GROUP BY ALL) v
    LEFT JOIN (SELECT origin, sensor, count(*) AS kept,
                      count(*) FILTER (WHERE epoch(received) - epoch(ts) > {late}) AS late,
                      count(*) FILTER (WHERE list_contains(flags, 'clock_unsynced')
                                          OR list_contains(flags, 'clock_corrected')) AS clock
               FROM readings GROUP BY ALL) k USING (origin, sensor)
"""
QUALITY_COLS = "origin, sensor, lines_in, kept, duplicates_removed, late, clock_flagged"
LATE_AFTER_S = 600  # pipeline/transforms.py: LATE_AFTER_S


def _spark_quality(con: duckdb.DuckDBPyConnection, warehouse: Path) -> str:
    if not (warehouse / "quality").exists():
        return f"SELECT {QUALITY_COLS} FROM quality WHERE false"
    sums = ", ".join(f"sum({c})::BIGINT AS {c}" for c in QUALITY_COLS.split(", ")[2:])
    base = spark_table(con, warehouse, "quality", "*")
    return f"SELECT origin, sensor, {sums} FROM ({base}) GROUP BY ALL"


def _spark_quarantine(con: duckdb.DuckDBPyConnection, warehouse: Path) -> str:
    if not list((warehouse / "quarantine").glob("*/*.parquet")):
        return "SELECT reason, id, origin, sensor FROM quarantine WHERE false"
    return spark_table(con, warehouse, "quarantine", "reason, id, origin, sensor")


def compare(con: duckdb.DuckDBPyConnection, warehouse: Path) -> dict[str, tuple[int, int, int]]:
    """Per table: (rows, rows only in Spark, rows only in DuckDB).

    ``quarantine`` is compared on (reason, id, origin, sensor); ``quality`` summed
    over batches per origin and sensor (lines in, kept, duplicates removed, late,
    clock-flagged).
    """
    out = {}
    con.execute(f"CREATE OR REPLACE TEMP VIEW quality AS {QUALITY_SQL.format(late=LATE_AFTER_S)}")
    for table, cols in (
        ("readings", READINGS_COLS),
        ("rollup_1m", ROLLUP_COLS),
        ("rollup_1h", ROLLUP_COLS),
        ("rollup_1d", ROLLUP_COLS),
        ("quarantine", "reason, id, origin, sensor"),
        ("quality", QUALITY_COLS),
    ):
        if table == "quarantine":
            spark = _spark_quarantine(con, warehouse)
        elif table == "quality":
            spark = _spark_quality(con, warehouse)
        else:
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
