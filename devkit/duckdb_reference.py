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
    "received: 'VARCHAR', record: 'JSON', _mqtt: 'JSON'}"
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
        CREATE OR REPLACE TABLE valid_all AS
        SELECT id, origin, sensor, t AS ts, value, unit, flags, k AS kind, gateway,
               r AS received, record
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
    # A sensor starting with "$" is the gateway's record, not a reading (issue 27).
    con.execute(
        "CREATE OR REPLACE TABLE valid AS SELECT * EXCLUDE (record) FROM valid_all "
        "WHERE NOT starts_with(sensor, '$')"
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
    build_completeness(con)
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


# ------------------------------------------------------------ records and completeness

LEDGER_TYPE = (
    'STRUCT(v INTEGER, "window" VARCHAR[], top BIGINT, streams MAP(VARCHAR, STRUCT('
    "held BIGINT[][], skipped BIGINT[][], stored BIGINT[][], "
    'evicted STRUCT("at" VARCHAR, ranges BIGINT[][])[], '
    'dead_letter STRUCT("at" VARCHAR, ranges BIGINT[][])[], '
    "refused MAP(VARCHAR, BIGINT[][]), node_dropped MAP(VARCHAR, BIGINT[][]))))"
)
REASONS = ("held", "evicted", "dead_letter", "refused", "node_dropped", "skipped")
COUNTS = ("held", "evicted", "dead_letter", "refused", "node_dropped", "unexplained", "unreported")


def _wts(x: str) -> str:
    """A wire time, or a number of seconds, as a timestamp (pipeline/completeness.wire_ts)."""
    return (
        f"coalesce(try_strptime({x}, {TS}), "
        f"make_timestamp((try_cast({x} AS DOUBLE) * 1e6)::BIGINT))"
    )


def build_completeness(con: duckdb.DuckDBPyConnection) -> None:
    """``records``, ``ledger``, and ``completeness`` and ``completeness_gaps`` one position
    at a time, from the rules in pipeline/completeness.py's docstring (Spark works on
    ranges: the two must agree)."""
    con.execute(
        """
        CREATE OR REPLACE TABLE recs AS SELECT * FROM valid_all WHERE starts_with(sensor, '$')
        QUALIFY row_number() OVER (
            PARTITION BY id
            ORDER BY coalesce(received, TIMESTAMP '9999-12-31'), coalesce(gateway, '')) = 1
        """
    )
    con.execute(
        "CREATE OR REPLACE TABLE records AS SELECT id, origin, sensor, ts, flags, record, "
        "gateway, received FROM recs WHERE sensor <> '$ledger'"
    )
    head = "id, gateway, epoch, seq, ts, window_start, window_end"
    con.execute(
        f"""
        CREATE OR REPLACE TABLE ledger AS
        WITH b AS (
            SELECT id, coalesce(gateway, origin) AS gateway, split_part(id, '/', 2) AS epoch,
                   try_cast(split_part(id, '/', 3) AS BIGINT) AS seq, ts,
                   try_cast(record AS {LEDGER_TYPE}) AS r
            FROM recs WHERE sensor = '$ledger'
        ), h AS (
            SELECT *, {_wts("r.window[1]")} AS window_start, {_wts("r.window[2]")} AS window_end
            FROM b WHERE seq IS NOT NULL
        ), s AS (
            SELECT {head}, unnest(map_keys(r.streams)) AS stream,
                   unnest(map_values(r.streams)) AS x
            FROM h
        ), rows AS (
            SELECT {head}, gateway || '/' || epoch AS stream, 'top' AS what,
                   NULL::VARCHAR AS reason, NULL::TIMESTAMP AS "at", r.top AS lo, r.top AS hi
            FROM h WHERE r.top IS NOT NULL
            UNION ALL
            SELECT {head}, stream, 'held', NULL, NULL, g[1], g[2] FROM s, unnest(x.held) u(g)
            UNION ALL
            SELECT {head}, stream, 'skipped', NULL, NULL, g[1], g[2]
            FROM s, unnest(x.skipped) u(g)
            UNION ALL
            SELECT {head}, stream, 'stored', NULL, NULL, g[1], g[2]
            FROM s, unnest(x.stored) u(g)
            UNION ALL
            SELECT {head}, stream, 'evicted', NULL, {_wts("e.at")}, g[1], g[2]
            FROM (SELECT *, unnest(x.evicted) AS e FROM s), unnest(e.ranges) u(g)
            UNION ALL
            SELECT {head}, stream, 'dead_letter', NULL, {_wts("e.at")}, g[1], g[2]
            FROM (SELECT *, unnest(x.dead_letter) AS e FROM s), unnest(e.ranges) u(g)
            UNION ALL
            SELECT {head}, stream, 'refused', m.key, NULL, g[1], g[2]
            FROM (SELECT *, unnest(map_entries(x.refused)) AS m FROM s), unnest(m.value) u(g)
            UNION ALL
            SELECT {head}, stream, 'node_dropped', m.key, NULL, g[1], g[2]
            FROM (SELECT *, unnest(map_entries(x.node_dropped)) AS m FROM s),
                 unnest(m.value) u(g)
        )
        SELECT * FROM rows WHERE lo IS NOT NULL AND hi IS NOT NULL AND lo <= hi AND lo >= 0
        """
    )
    # Landed positions: the store spans of the receive records, the node messages of the
    # reading ids; a position's time the earliest of its copies' (ts, else received).
    con.execute(
        f"""
        CREATE OR REPLACE TABLE landed_pos AS
        WITH l AS (
            SELECT id, gateway, coalesce(try_strptime(ts, {TS}), try_strptime(received, {TS}))
                   AS t, json_extract_string(_mqtt, '$.outbox.epoch') AS epoch,
                   try_cast(json_extract(_mqtt, '$.outbox.first') AS BIGINT) AS f,
                   try_cast(json_extract(_mqtt, '$.outbox.last') AS BIGINT) AS z,
                   split_part(id, '/', 3) AS tail
            FROM lines WHERE gateway IS NOT NULL
        ), p AS (
            SELECT gateway, gateway || '/' || epoch AS stream, unnest(range(f, z + 1)) AS pos, t
            FROM l WHERE epoch IS NOT NULL AND f <= z
            UNION ALL
            SELECT gateway, split_part(id, '/', 1) || '/' || split_part(id, '/', 2),
                   try_cast(split_part(tail, '.', 1) AS BIGINT), t
            FROM l
            WHERE length(id) - length(replace(id, '/', '')) = 2
              AND length(tail) - length(replace(tail, '.', '')) = 1
              AND try_cast(split_part(tail, '.', 1) AS BIGINT)::VARCHAR = split_part(tail, '.', 1)
              AND try_cast(split_part(tail, '.', 2) AS BIGINT)::VARCHAR = split_part(tail, '.', 2)
        )
        SELECT gateway, stream, pos, min(t) AS t FROM p GROUP BY ALL
        """
    )
    prio = " ".join(f"WHEN '{r}' THEN {i}" for i, r in enumerate(REASONS))
    names = ", ".join(f"'{r}'" for r in REASONS)
    con.execute(
        f"""
        CREATE OR REPLACE TABLE missing_pos AS
        WITH latest AS (
            SELECT gateway, id AS latest, coalesce(window_end, ts) AS last_t FROM ledger
            QUALIFY row_number() OVER (PARTITION BY gateway
                ORDER BY coalesce(window_end, ts) DESC, seq DESC, id DESC) = 1
        ), streams AS (
            SELECT gateway, stream,
                   CASE WHEN split_part(stream, '/', 1) = gateway THEN 1 ELSE 0 END AS first,
                   max(told) AS told, greatest(max(got), coalesce(max(told), -1)) AS top
            FROM (SELECT gateway, stream, pos AS got, NULL::BIGINT AS told FROM landed_pos
                  UNION ALL SELECT gateway, stream, NULL, hi FROM ledger)
            GROUP BY ALL
        ), expected AS (
            SELECT s.gateway, s.stream, s.told, l.last_t,
                   unnest(range(s.first, s.top + 1)) AS pos
            FROM streams s LEFT JOIN latest l USING (gateway)
        ), why AS (
            SELECT gateway, stream, what, reason, window_end AS rt, lo, hi FROM ledger
            WHERE what = 'held' AND id IN (SELECT latest FROM latest)
            UNION ALL
            SELECT gateway, stream, what, reason,
                   CASE WHEN what IN ('evicted', 'dead_letter') THEN "at" ELSE window_start END,
                   lo, hi
            FROM ledger WHERE what IN ({names}) AND what <> 'held'
        ), m AS (
            SELECT e.* FROM expected e
            WHERE NOT EXISTS (SELECT 1 FROM landed_pos p
                              WHERE (p.gateway, p.stream, p.pos) = (e.gateway, e.stream, e.pos))
        ), hit AS (
            SELECT m.*, CASE w.what {prio} END AS prio, w.rt, w.reason AS detail
            FROM m LEFT JOIN why w
              ON (w.gateway, w.stream) = (m.gateway, m.stream) AND m.pos BETWEEN w.lo AND w.hi
            QUALIFY row_number() OVER (PARTITION BY m.gateway, m.stream, m.pos
                ORDER BY prio NULLS FIRST, rt NULLS FIRST, detail NULLS FIRST) = 1
        ), nxt AS (
            SELECT h.*, (SELECT arg_min(p.t, p.pos) FROM landed_pos p
                         WHERE (p.gateway, p.stream) = (h.gateway, h.stream) AND p.pos > h.pos)
                        AS nt
            FROM hit h
        )
        SELECT gateway, stream, pos,
               CASE WHEN prio IS NOT NULL THEN [{names}][prio + 1]
                    WHEN pos <= told THEN 'unexplained' ELSE 'unreported' END AS reason,
               detail, date_trunc('hour', coalesce(rt, nt, last_t)) AS hour
        FROM nxt
        """
    )
    kind = "CASE WHEN split_part(stream, '/', 1) = gateway THEN 'store' ELSE 'node' END"
    con.execute(
        f"""
        CREATE OR REPLACE TABLE completeness_gaps AS
        SELECT gateway, stream, {kind} AS kind, min(pos) AS lo, max(pos) AS hi,
               count(*) AS n, reason, detail, hour
        FROM (SELECT *, pos - row_number() OVER (
                  PARTITION BY gateway, stream, reason, detail, hour ORDER BY pos) AS g
              FROM missing_pos)
        GROUP BY gateway, stream, reason, detail, hour, g
        """
    )
    counts = ", ".join(f"count(*) FILTER (WHERE reason = '{c}') AS {c}" for c in COUNTS)
    missing = " + ".join(COUNTS)
    con.execute(
        f"""
        CREATE OR REPLACE TABLE completeness AS
        WITH skip AS (SELECT DISTINCT gateway, stream, pos FROM ledger,
                      unnest(range(lo, hi + 1)) u(pos) WHERE what = 'skipped'),
        ev AS (
            SELECT l.gateway, l.stream, date_trunc('hour', l.t) AS hour,
                   CASE WHEN s.pos IS NULL THEN 'landed' ELSE 'skipped' END AS reason
            FROM landed_pos l LEFT JOIN skip s USING (gateway, stream, pos)
            UNION ALL SELECT gateway, stream, hour, reason FROM missing_pos
        ), c AS (
            SELECT gateway, stream, hour,
                   count(*) FILTER (WHERE reason = 'landed') AS landed, {counts},
                   count(*) FILTER (WHERE reason = 'skipped') AS skipped
            FROM ev GROUP BY ALL
        )
        SELECT gateway, stream, {kind} AS kind, hour, landed + {missing} AS expected, landed,
               {missing} AS missing, {", ".join(COUNTS)}, skipped
        FROM c
        """
    )


LEDGER_COLS = (
    "id, gateway, epoch, seq, ts::TIMESTAMP AS ts, window_start::TIMESTAMP AS window_start, "
    'window_end::TIMESTAMP AS window_end, stream, what, reason, "at"::TIMESTAMP AS "at", lo, hi'
)
RECORDS_COLS = "id, origin, sensor, ts::TIMESTAMP AS ts, flags, gateway"
COMPLETENESS_COLS = (
    "gateway, stream, kind, hour::TIMESTAMP AS hour, expected, landed, missing, "
    + ", ".join(COUNTS)
    + ", skipped"
)
# Tables a warehouse may have no rows in (a fleet without records, ledgers or gaps).
MAY_BE_EMPTY = ("quarantine", "records", "ledger", "completeness", "completeness_gaps")
GAPS_COLS = "gateway, stream, kind, lo, hi, n, reason, detail, hour::TIMESTAMP AS hour"


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
        ("records", RECORDS_COLS),
        ("ledger", LEDGER_COLS),
        ("completeness", COMPLETENESS_COLS),
        ("completeness_gaps", GAPS_COLS),
    ):
        if table == "quarantine":
            spark = _spark_quarantine(con, warehouse)
        elif table == "quality":
            spark = _spark_quality(con, warehouse)
        elif not any((warehouse / table).rglob("*.parquet")):  # never written: no rows
            spark = f"SELECT {cols.replace('::TIMESTAMP', '')} FROM {table} WHERE false"
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
