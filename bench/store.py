"""Store benchmark on PostgreSQL: batch ingest rate, and the p95 of a downsampled series query
with 10 million points in the table.

Fills the table to --rows points (other jobs' series, bulk-inserted with generate_series), then
measures ingest of one 100,000-step job with 10 series through the same upsert the workers use,
in batches, and finally queries one of its series (100,000 points) downsampled to 1,000.

    python bench/store.py [--url postgresql+psycopg://postgres@127.0.0.1:5432/test] [--rows 10000000]

Ends with: RESULT ingest_points_per_s=... query_p95_ms=... rows=...
"""

from __future__ import annotations

import argparse
import statistics
import time

from scratch_db import (  # bench/ is on the path when a bench runs
    DEFAULT_URL,
    scratch_database,
)
from sqlalchemy import func, select, text

from service.store import jobs as jobs_q
from service.store import metrics as metrics_q
from service.store.db import get_engine, session_scope
from service.store.migrate import upgrade
from service.store.models import Metric


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=DEFAULT_URL,
                    help="an existing database; the benchmark works in a scratch database beside it")
    ap.add_argument("--rows", type=int, default=10_000_000, help="points in the table when querying")
    ap.add_argument("--steps", type=int, default=100_000, help="steps of the measured job")
    ap.add_argument("--series", type=int, default=10, help="series of the measured job")
    ap.add_argument("--batch", type=int, default=50_000, help="points per ingest batch")
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--keep", action="store_true", help="keep the scratch database")
    args = ap.parse_args()

    with scratch_database(args.url, keep=args.keep) as url:
        run(url, args)


def run(url: str, args) -> None:
    upgrade(url)
    measured = args.steps * args.series
    filler = max(0, args.rows - measured)
    with session_scope(url) as s:
        job, _ = jobs_q.create_job(s, owner="bench", kind="grpo", spec={}, name="measured", total_steps=args.steps)
        other, _ = jobs_q.create_job(s, owner="bench", kind="grpo", spec={}, name="filler", total_steps=0)
        keys = [f"bench/series_{i}" for i in range(args.series)]
        ids = metrics_q.key_ids(s, names=keys + ["filler/a", "filler/b"], create=True)
    t0 = time.perf_counter()
    if filler:
        with session_scope(url) as s:  # other jobs' history: bulk SQL, not part of the measurement
            s.execute(text(
                "INSERT INTO metrics (job_id, key_id, step, value, created_at) "
                "SELECT :j, CASE WHEN g % 2 = 0 THEN :a ELSE :b END, g / 2, random(), now() "
                "FROM generate_series(0, :n - 1) AS g"), {"j": other.id, "a": ids["filler/a"], "b": ids["filler/b"],
                                                          "n": filler})
        print(f"filled {filler:,} rows in {time.perf_counter() - t0:.1f} s")

    # ingest: the measured job's points in batches, step-major as a long run would report them
    points = ((job.id, keys[i % args.series], i // args.series, (i % 97) / 97.0) for i in range(measured))
    t0 = time.perf_counter()
    done = 0
    while done < measured:
        batch = [next(points) for _ in range(min(args.batch, measured - done))]
        with session_scope(url) as s:
            done += metrics_q.upsert_points(s, rows=batch)
    ingest_s = time.perf_counter() - t0
    # what autovacuum does on a live server: refresh the visibility map (index-only scans) and stats
    with get_engine(url).connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text("VACUUM ANALYZE metrics"))
    with session_scope(url) as s:
        total = s.scalar(select(func.count()).select_from(Metric))

    lat = []
    for q in range(args.queries + 3):
        t = time.perf_counter()
        with session_scope(url) as s:
            out = metrics_q.series(s, job_id=job.id, key=keys[q % args.series], max_points=1000)
        if q >= 3:  # the first few warm the cache
            lat.append((time.perf_counter() - t) * 1000)
        assert out.downsampled and len(out.points) <= 1000 and out.total_points == args.steps
    p95 = statistics.quantiles(lat, n=20)[-1]
    print(f"ingested {measured:,} points in {ingest_s:.1f} s; {args.queries} queries, "
          f"median {statistics.median(lat):.1f} ms")
    print(f"RESULT ingest_points_per_s={measured / ingest_s:.0f} query_p95_ms={p95:.1f} rows={total}")


if __name__ == "__main__":
    main()
