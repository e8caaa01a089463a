"""Pipeline benchmark: ``pubcomp pipeline run`` against a plain Spark batch job and DuckDB.

Same run, same landing files (synthetic: 1,000 sensors, 100 origins, 5%
duplicates, 1% late by up to 90 minutes):

- full run: the incremental pipeline on an empty warehouse, a plain Spark batch
  job doing the same parse/dedup/rollups in one pass (no checkpoint, no seen-id
  index, no quarantine or quality tables, no re-reads), and DuckDB doing the
  same dedup and rollups from the same files; the pipeline's tables (quarantine
  and quality included) are compared with DuckDB's (they must be equal);
- incremental: M new readings on top of the N, against the same M on an empty
  warehouse (cost should follow new data, not history);
- ingest: readings/s landed durably by ``pubcomp ingest run`` from G uplinks
  publishing at once through a local Mosquitto.

Targets (issue 5, tightened by issue 14): full run <= 1.5x the plain batch job;
incremental <= 1.5x the empty-warehouse run; ingest >= 30,000 readings/s.

``--fleet`` (issue 27): a fleet's landing files (devkit/fleetsim.py: gateways with
nine nodes each, so S streams are S/10 gateways' stores and their nodes' boots;
duplicates, late files, restarts, evictions, ...). For each S in ``--streams``
and each history size H in ``--histories`` (landing lines), in one run: the
history landed and run, then the next ``--increment`` lines: the increment on
top of H (on a copy of the warehouse), the same increment on an empty warehouse,
and the plain batch job over it. Targets: the increment within 1.2x of itself
whatever H (``inc/first``: against the same fleet's increment over the smallest H;
``inc/alone``, the stricter reading: against an empty warehouse); the pipeline at
most 1.3x the plain batch job. ``--driver-memory`` (4g): local mode's tasks share
the driver's heap, and Spark's 1g ran out landing 9M lines on a 1M warehouse.

Both modes first warm the JVM up on a small sample; ``--no-warm-up`` skips that
(tests/test_bench_smoke.py: it checks that the bench runs and agrees with DuckDB,
and its figures then include the JVM's first runs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from devkit import duckdb_reference as ref  # noqa: E402
from pubcomp.pipeline import transforms as T  # noqa: E402
from pubcomp.pipeline.job import Pipeline, spark_session  # noqa: E402
from pubcomp.pipeline.synth import write_landing  # noqa: E402


def plain_batch(spark, landing: Path, out: Path) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    lines = (
        spark.read.schema(T.LANDING_SCHEMA)
        .option("columnNameOfCorruptRecord", T.CORRUPT)
        .option("recursiveFileLookup", "true")
        .json(str(landing))
    )
    readings = T.first_copy_per_id(T.valid_readings(T.parse_landing(lines), 0)).persist()
    readings.write.mode("overwrite").partitionBy("date", "hour").parquet(str(out / "readings"))
    m = T.rollup_minutes(readings).persist()
    m.write.mode("overwrite").partitionBy("date", "hour").parquet(str(out / "rollup_1m"))
    h = T.rollup_up(m, "hour").persist()
    h.write.mode("overwrite").partitionBy("date").parquet(str(out / "rollup_1h"))
    T.rollup_up(h, "day").write.mode("overwrite").partitionBy("date").parquet(
        str(out / "rollup_1d")
    )
    for df in (readings, m, h):
        df.unpersist()
    return time.monotonic() - t0


def warm_up(spark, tmp: Path) -> None:  # type: ignore[no-untyped-def]
    """Warm the JVM up on a small sample, so neither contender pays for it: the plain
    job, and the pipeline's first run and an increment (which reads the index and
    joins: code the full run never runs, so the increment timed first paid for it)."""
    write_landing(tmp / "warm", 20_000, seed=42)
    plain_batch(spark, tmp / "warm", tmp / "warm-out")
    Pipeline(spark, str(tmp / "warm"), str(tmp / "warm-wh")).run()
    write_landing(tmp / "warm", 2_000, seed=42, id_offset=20_000, name="more")
    Pipeline(spark, str(tmp / "warm"), str(tmp / "warm-wh")).run()


class _LineCounter:
    """Landing lines so far, reading only what each file gained since the last call.

    Re-reading every file at each poll (100 MB by the end) took CPU from the ingest
    being measured. Files keep their name when rolled, so the offset carries over."""

    def __init__(self, landing: Path) -> None:
        self.landing = landing
        self.seen: dict[str, tuple[int, int]] = {}  # file name -> (bytes read, newlines)

    def __call__(self) -> int:
        files = [
            *self.landing.glob("date=*/*.jsonl"),
            *self.landing.glob("_incoming/readings/*.jsonl"),
        ]
        for f in files:
            offset, n = self.seen.get(f.name, (0, 0))
            try:
                with f.open("rb") as fh:
                    fh.seek(offset)
                    data = fh.read()
            except FileNotFoundError:  # rolled between listing and read
                continue
            self.seen[f.name] = (offset + len(data), n + data.count(b"\n"))
        return sum(n for _, n in self.seen.values())


def _landing_lag(stores: list[Path], stop: threading.Event, worst: list[float]) -> None:
    """The oldest delivered-but-not-landed message's age across the stores, sampled: how
    long the end-to-end acknowledgement lags behind the broker's PUBCOMP."""
    import sqlite3

    while not stop.wait(0.2):
        for path in stores:
            try:
                db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
                try:
                    row = db.execute("SELECT MIN(delivered) FROM awaiting_landing").fetchone()
                finally:
                    db.close()
            except sqlite3.Error:
                continue
            if row and row[0] is not None:
                worst[0] = max(worst[0], time.time() - row[0])


def ingest_rate(
    tmp: Path, gateways: int, per_gateway: int, end_to_end: bool = True
) -> tuple[float, float]:
    """Readings/s landed from ``gateways`` uplinks draining at once, and (end to end) the
    longest a delivered message waited for its landed acknowledgement."""
    from devkit.broker import Mosquitto
    from devkit.ingest_helpers import IngestProc
    from devkit.uplink_helpers import fill_store, start_uplink

    tmp = tmp / ("e2e" if end_to_end else "hop")
    broker = Mosquitto(tmp / "broker").start()
    stop, worst = threading.Event(), [0.0]
    try:
        landing = tmp / "ingest-landing"
        ing = IngestProc(broker.port, landing, "bench-ingest").start()
        for g in range(gateways):
            fill_store(tmp / f"gw{g}.db", per_gateway, gateway=f"gw{g}")
        t0 = time.monotonic()
        stores = [tmp / f"gw{g}.db" for g in range(gateways)]
        sampler = threading.Thread(target=_landing_lag, args=(stores, stop, worst), daemon=True)
        sampler.start()
        ups = [
            # End to end: the ingest acknowledges what it lands (issue 24), and an
            # uplink is drained once all of its readings are landed.
            start_uplink(
                tmp / f"gw{g}.db",
                broker.url,
                "--exit-when-drained",
                "--client-id",
                f"gw{g}",
                end_to_end=end_to_end,
            )
            for g in range(gateways)
        ]
        want = gateways * per_gateway
        lines = _LineCounter(landing)
        while lines() < want:  # counting newlines: cheap, unlike parsing
            assert all(u.poll() in (None, 0) for u in ups), "an uplink failed"
            time.sleep(0.2)
        # The rate is the landing's; the uplinks exit after (end to end: once the last
        # acknowledgement has let their readings go, up to a second and a commit later).
        elapsed = time.monotonic() - t0
        for u in ups:
            u.wait(600)
            assert u.returncode == 0, u.stderr.read() if u.stderr else ""
        ing.stop()
        return want / elapsed, worst[0]
    finally:
        stop.set()
        broker.kill()


def _sizes(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def _index_size(wh: Path) -> tuple[int, int]:
    """Files and bytes of the dedup index (whatever its tables are called)."""
    files = [f for d in wh.glob("seen_*") for f in d.rglob("*.parquet")]
    return len(files), sum(f.stat().st_size for f in files)


def _move(files: list[dict], src: Path, dest: Path, copy_to: Path | None = None) -> int:
    lines = 0
    for f in files:
        target = dest / f["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        if copy_to is not None:
            extra = copy_to / f["file"]
            extra.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / f["file"], extra)
        shutil.move(src / f["file"], target)
        lines += f["lines"]
    return lines


def _take(manifest: list[dict], lines: int) -> tuple[list[dict], list[dict]]:
    """The first files holding at least ``lines`` lines, and the rest."""
    n = 0
    for k, f in enumerate(manifest):
        if n >= lines:
            return manifest[:k], manifest[k:]
        n += f["lines"]
    return manifest, []


def fleet(args: argparse.Namespace) -> int:
    from devkit.fleetsim import FleetSpec, simulate

    histories, increment = sorted(_sizes(args.histories)), args.increment
    rows: list[tuple] = []
    equal_all = True
    if args.tmp is not None:  # a folder to hold the run's own temporary one
        Path(args.tmp).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        tmp = Path(d)
        spark = spark_session(args.master, "pubcomp-bench-fleet", args.driver_memory)
        spark.sparkContext.setLogLevel("ERROR")
        if args.warm_up:
            warm_up(spark, tmp)
        for streams in _sizes(args.streams):
            gateways = max(1, streams // 10)
            small = gateways < 100  # a small fleet: a file per ingest per hour, not a minute
            t0 = time.monotonic()
            gen = tmp / f"gen-{streams}"
            spec = FleetSpec(
                gateways=gateways, nodes=9, readings=int((histories[-1] + increment) * 1.02),
                seed=streams, roll_minutes=60 if small else 1, restarts=1,
                replacements=max(1, gateways // 100), outages=max(1, gateways // 100),
                node_drops=max(2, gateways // 50), unexplained=max(2, gateways // 100),
                reboots=max(1, gateways // 20),
            )  # fmt: skip
            truth = simulate(gen, spec)
            print(
                f"S={streams}: simulated {truth['lines']:,} lines, {len(truth['streams']):,} "
                f"streams, {len(truth['files'])} files in {time.monotonic() - t0:.0f} s",
                flush=True,
            )
            landing, wh = tmp / f"landing-{streams}", tmp / f"wh-{streams}"
            rest = truth["files"]
            landed = 0
            for h in histories:
                # The history lands in runs of at most --history-batch lines, as a
                # warehouse's history arrives over batches (and no run holds 40M lines).
                hist_s, runs = 0.0, 0
                while landed < h or not runs:
                    hist, rest = _take(rest, min(h - landed, int(args.history_batch)))
                    if not hist and runs:
                        break
                    landed += _move(hist, gen, landing)
                    runs += 1
                    t0 = time.monotonic()
                    hs = Pipeline(spark, str(landing), str(wh)).run()
                    hist_s += time.monotonic() - t0
                inc_files, rest = _take(rest, increment)
                alone_landing = tmp / "alone-landing"
                wh_inc = tmp / "wh-inc"
                shutil.copytree(wh, wh_inc)
                inc_lines = _move(inc_files, gen, landing, copy_to=alone_landing)
                landed += inc_lines
                inc = Pipeline(spark, str(landing), str(wh_inc)).run()
                idx_files, idx_bytes = _index_size(wh_inc)
                alone = Pipeline(spark, str(alone_landing), str(tmp / "wh-alone")).run()
                plain_s = plain_batch(spark, alone_landing, tmp / "plain-out")
                verdict = "not checked"
                if h <= args.check_upto:
                    con = ref.build(landing)
                    same = ref.compare(con, wh_inc)
                    equal = all(a == b == 0 for _, a, b in same.values())
                    equal_all &= equal
                    verdict = "equal" if equal else f"DIFFERENT {same}"
                    con.close()
                rows.append(
                    (streams, landed - inc_lines, hist_s, hs.seconds, inc_lines, inc.seconds,
                     alone.seconds, plain_s, idx_files, idx_bytes, os.getloadavg()[0], verdict)
                )  # fmt: skip
                print(_fleet_row(rows[-1], rows), flush=True)
                for p in (wh_inc, alone_landing, tmp / "wh-alone", tmp / "plain-out"):
                    shutil.rmtree(p, ignore_errors=True)
            shutil.rmtree(landing, ignore_errors=True)
            shutil.rmtree(wh, ignore_errors=True)
            shutil.rmtree(gen, ignore_errors=True)
        spark.stop()
    print(f"fleet mode, increment {increment:,} lines, {args.master}")
    print(
        "  streams  history-lines  history-s  inc-lines  increment-s  alone-s  plain-s  "
        "inc/alone  inc/first  alone/plain  inc/plain  index-files  index-MB  load  tables"
    )
    for r in rows:
        print(_fleet_row(r, rows))
    return 0 if equal_all else 1


def _fleet_row(r: tuple, rows: list[tuple]) -> str:
    """A row of the table; ``inc/first``: the increment against the same fleet's over the
    smallest history (the issue's "within 1.2x of itself whatever the history size")."""
    streams, hist, hist_s, _, inc_lines, inc_s, alone_s, plain_s, files, size, load, verdict = r
    first = next(x[5] for x in rows if x[0] == streams)
    return (
        f"  {streams:>7,}  {hist:>13,}  {hist_s:>9.1f}  {inc_lines:>9,}  "
        f"{inc_s:>11.1f}  {alone_s:>7.1f}  {plain_s:>7.1f}  {inc_s / alone_s:>9.2f}  "
        f"{inc_s / first:>9.2f}  {alone_s / plain_s:>11.2f}  "
        f"{inc_s / plain_s:>9.2f}  {files:>11,}  {size / 1e6:>8.1f}  {load:>4.1f}  {verdict}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readings", type=int, default=10_000_000)
    ap.add_argument("--incremental", type=int, default=1_000_000)
    ap.add_argument("--gateways", type=int, default=10)
    ap.add_argument("--per-gateway", type=int, default=50_000)
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--ingest-only", action="store_true", help="measure the ingest only")
    ap.add_argument("--fleet", action="store_true", help="the fleet mode (issue 27)")
    ap.add_argument("--histories", default="1e6,1e7,5e7", help="fleet: history sizes, lines")
    ap.add_argument("--streams", default="100,10000", help="fleet: active streams")
    ap.add_argument("--check-upto", type=float, default=1e7, help="fleet: DuckDB check up to H")
    ap.add_argument(
        "--history-batch", type=float, default=1e7, help="fleet: the history's lines per run"
    )
    ap.add_argument("--tmp", default=None, help="fleet: where the landing and warehouses go")
    ap.add_argument(
        "--driver-memory",
        default="4g",
        help="Spark's driver heap (local mode: every task's); 1g ran out at 10M of history",
    )
    ap.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="skip the JVM's warm-up runs (the figures then include it: for smoke tests)",
    )
    args = ap.parse_args()
    if args.fleet:
        args.increment = args.incremental
        return fleet(args)
    if args.ingest_only:
        with tempfile.TemporaryDirectory() as d:
            rates = _ingest_rates(Path(d), args)
        print(_ingest_line(rates, args))
        return 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        landing, extra = tmp / "landing", tmp / "extra"
        t0 = time.monotonic()
        chunks = 10
        lines = 0
        for c in range(chunks):
            lines += write_landing(
                landing, args.readings // chunks, origins=100, sensors=1000, seed=c + 1,
                id_offset=c * (args.readings // chunks), files=4,
            )  # fmt: skip
        # The increment is what a fleet delivers next: the following hours (with their
        # own 1% late readings), not a scatter over all of history.
        history_s = 2 * 86400.0
        write_landing(
            extra, args.incremental, origins=100, sensors=1000, seed=99, id_offset=10**9,
            start=datetime(2026, 11, 20, tzinfo=UTC) + timedelta(seconds=history_s),
            span_s=history_s * args.incremental / args.readings,
        )  # fmt: skip
        print(f"generated {lines:,} landing lines in {time.monotonic() - t0:.0f} s", flush=True)
        spark = spark_session(args.master, "pubcomp-bench", args.driver_memory)
        spark.sparkContext.setLogLevel("ERROR")
        if args.warm_up:
            warm_up(spark, tmp)

        plain_s = plain_batch(spark, landing, tmp / "plain")
        full = Pipeline(spark, str(landing), str(tmp / "wh")).run()
        t0 = time.monotonic()
        con = ref.build(landing, quarantine=False)
        duck_s = time.monotonic() - t0
        ref.build_quarantine(landing, con)  # for the comparison only, not timed
        same = ref.compare(con, tmp / "wh")
        equal = all(a == b == 0 for _, a, b in same.values())

        # Incremental: the extra readings on top of the full warehouse, and alone.
        for f in extra.rglob("*.jsonl"):
            dest = landing / f.relative_to(extra)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dest)
        inc = Pipeline(spark, str(landing), str(tmp / "wh")).run()
        alone = Pipeline(spark, str(extra), str(tmp / "wh-alone")).run()
        spark.stop()
        rates = _ingest_rates(tmp, args)

    n = args.readings
    print(f"pipeline, {n:,} readings ({lines - n:,} duplicate lines), {args.master}")
    print(f"{'':44}{'seconds':>10}{'readings/s':>14}{'ratio':>8}")
    rows = [
        ("pubcomp pipeline run (incremental design)", full.seconds),
        ("plain Spark batch job (peer)", plain_s),
        ("DuckDB, same dedup and rollups", duck_s),
    ]
    for label, secs in rows:
        print(f"  {label:42}{secs:>10.1f}{n / secs:>14,.0f}{secs / plain_s:>8.2f}")
    verdict = "equal" if equal else f"DIFFERENT {same}"
    print(f"  pipeline tables vs DuckDB: {verdict} ({same['readings'][0]:,} readings)")
    print(
        f"incremental: {args.incremental:,} new on top of {n:,}: {inc.seconds:.1f} s; "
        f"the same on an empty warehouse: {alone.seconds:.1f} s; "
        f"ratio {inc.seconds / alone.seconds:.2f}"
    )
    print(_ingest_line(rates, args))
    return 0 if equal else 1


def _ingest_rates(tmp: Path, args: argparse.Namespace) -> tuple[float, float, float]:
    """End to end (acknowledgements on), then the hop alone (off), in the same run."""
    rate, lag = ingest_rate(tmp, args.gateways, args.per_gateway, end_to_end=True)
    hop, _ = ingest_rate(tmp, args.gateways, args.per_gateway, end_to_end=False)
    return rate, lag, hop


def _ingest_line(rates: tuple[float, float, float], args: argparse.Namespace) -> str:
    rate, lag, hop = rates
    return (
        f"ingest: {rate:,.0f} readings/s landed (fsync before PUBREC) from "
        f"{args.gateways} uplinks x {args.per_gateway:,} readings, acknowledging what "
        f"landed; {hop:,.0f} without the acknowledgements (ratio {rate / hop:.2f}); "
        f"longest wait for a landed acknowledgement {lag:.1f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
