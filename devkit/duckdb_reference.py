"""The same dedup and rollups in DuckDB, from the same landing files: the second engine.

Written from the rules in pipeline/transforms.py's docstring, in plain SQL, and
sharing no code with the Spark job. ``compare`` checks Spark's Parquet tables
against these, row for row and column for column, both directions (EXCEPT ALL).

The dedup here is the rule stated once over all the landing files, with no
notion of batches or runs: per id, the copy received first (then the smallest
gateway name) is the reading, whatever its ``ts``. Spark reaches the same
table one batch at a time through its seen index; any difference in how
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


# ------------------------------------------------------------ the seen index (issue 27)

POS_SCALE = 1000  # pipeline/seenindex.py: position = seq * 1000 + i
MAX_SEQ = 2**53 - 1
KEPT_POSITIONS = rf"""
    CREATE OR REPLACE TABLE kept_positions AS
    WITH p AS (
        SELECT id, split_part(id, '/', 1) AS origin, split_part(id, '/', 2) AS epoch,
               split_part(id, '/', 3) AS tail,
               length(id) - length(replace(id, '/', '')) AS slashes
        FROM readings
    ), q AS (
        SELECT *, length(tail) - length(replace(tail, '.', '')) AS dots,
               split_part(tail, '.', 1) AS seq_s,
               CASE WHEN contains(tail, '.') THEN split_part(tail, '.', 2) ELSE '0' END AS i_s
        FROM p
    )
    SELECT id, origin, epoch, dots = 1 AS dotted,
           seq_s::BIGINT * {POS_SCALE} + i_s::BIGINT AS pos
    FROM q
    WHERE slashes = 2 AND origin <> '' AND epoch <> '' AND dots <= 1
      AND regexp_full_match(seq_s, '0|[1-9][0-9]{{0,15}}')
      AND seq_s::HUGEINT <= {MAX_SEQ}
      AND regexp_full_match(i_s, '0|[1-9][0-9]{{0,2}}')
"""
# A stream's kept positions as runs, by the rule in pipeline/seenindex.py's docstring:
# pieces (contiguous indexes of one message), chained over consecutive messages.
KEPT_RANGES = f"""
    CREATE OR REPLACE TABLE kept_ranges AS
    WITH pos AS (
        SELECT origin, epoch, dotted, pos // {POS_SCALE} AS s, pos % {POS_SCALE} AS i
        FROM kept_positions
    ), pieces AS (
        SELECT origin, epoch, dotted, s, min(i) AS a, max(i) AS b
        FROM (SELECT *, i - row_number() OVER (PARTITION BY origin, epoch, dotted, s ORDER BY i)
                     AS g FROM pos)
        GROUP BY origin, epoch, dotted, s, g
    ), fit AS (
        SELECT *, coalesce(s = lag(s) OVER w + 1 AND a = 0 AND b <= lag(b) OVER w, false) AS fits
        FROM pieces WINDOW w AS (PARTITION BY origin, epoch, dotted ORDER BY s, a)
    ), st AS (
        SELECT *, NOT fits OR (coalesce(lag(fits) OVER w, false)
                               AND lag(b) OVER w <> lag(b, 2) OVER w) AS start
        FROM fit WINDOW w AS (PARTITION BY origin, epoch, dotted ORDER BY s, a)
    ), runs AS (
        SELECT *, sum(CASE WHEN start THEN 1 ELSE 0 END) OVER (
                      PARTITION BY origin, epoch, dotted ORDER BY s, a
                      ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS run
        FROM st
    )
    SELECT origin, epoch, dotted, min(s * {POS_SCALE} + a) AS lo, max(s * {POS_SCALE} + b) AS hi,
           (CASE WHEN count(*) = 1 THEN max(b) ELSE arg_min(b, s) END + 1)::INTEGER AS width,
           sum(b - a + 1)::BIGINT AS n
    FROM runs GROUP BY origin, epoch, dotted, run
"""


def build_index(con: duckdb.DuckDBPyConnection) -> None:
    """``kept_positions`` (each kept id that is a stream position) and ``kept_ranges`` (the
    same as runs), from ``readings``: what the seen index must claim."""
    con.execute(KEPT_POSITIONS)
    con.execute(KEPT_RANGES)


def compare_index(con: duckdb.DuckDBPyConnection, warehouse: Path) -> dict[str, int]:
    """Spark's seen index against what DuckDB kept (``build_index`` first). Every count
    is 0 when the index is right:

    - ``claimed_not_kept``: positions an exact run claims that are not kept, or that two
      runs claim (EXCEPT ALL);
    - ``kept_not_claimed``: kept positions no run covers (an exact one, or an envelope's span);
    - ``streams_miscounted``: streams whose runs' ``n`` do not add up to their kept positions;
    - ``odd_not_excepted``: kept ids that are no stream position and have no exception row.
    """
    ranges = f"{warehouse}/seen_ranges/**/*.parquet"
    con.execute(f"CREATE OR REPLACE TEMP VIEW spark_ranges AS {_read(ranges)}")
    exact = f"""
        SELECT origin, epoch, dotted, pos FROM (
            SELECT r.origin, r.epoch, r.dotted, s * {POS_SCALE} + i AS pos, r.lo, r.hi
            FROM spark_ranges r,
                 generate_series(r.lo // {POS_SCALE}, r.hi // {POS_SCALE}) AS g(s),
                 generate_series(0, r.width - 1) AS h(i)
            WHERE r.exact)
        WHERE pos BETWEEN lo AND hi
    """
    kept = "SELECT origin, epoch, dotted, pos FROM kept_positions"
    out = {
        "claimed_not_kept": _count(con, f"{exact} EXCEPT ALL {kept}"),
        "kept_not_claimed": _count(
            con,
            f"""SELECT * FROM kept_positions k WHERE NOT EXISTS (
                    SELECT 1 FROM spark_ranges r
                    WHERE (r.origin, r.epoch, r.dotted) = (k.origin, k.epoch, k.dotted)
                      AND k.pos BETWEEN r.lo AND r.hi AND k.pos % {POS_SCALE} < r.width)""",
        ),
        "streams_miscounted": _count(
            con,
            """SELECT origin, epoch, dotted, count(*) FROM kept_positions GROUP BY ALL
                EXCEPT SELECT origin, epoch, dotted, sum(n) FROM spark_ranges GROUP BY ALL""",
        ),
    }
    odd = "SELECT id FROM readings EXCEPT SELECT id FROM kept_positions"
    exceptions = f"{warehouse}/seen_exceptions/**/*.parquet"
    if list((warehouse / "seen_exceptions").glob("*/*/*.parquet")):
        odd += f" EXCEPT SELECT id FROM ({_read(exceptions)})"
    out["odd_not_excepted"] = _count(con, odd)
    return out


def _read(glob: str) -> str:
    return f"SELECT * FROM read_parquet('{glob}', hive_partitioning = true)"


def _count(con: duckdb.DuckDBPyConnection, sql: str) -> int:
    row = con.execute(f"SELECT count(*) FROM ({sql})").fetchone()
    return int(row[0]) if row else 0
