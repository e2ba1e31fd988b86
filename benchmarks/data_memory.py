"""Host memory and time of loading chat data: ``load_dataset`` on shakespeare-chat repeated ``--copies`` times (one
JSON lines file, 10 copies: 104 MB, 297,100 records, 37M tokens), packed into rows of ``--seq-len`` + 1 tokens with
the embedded SmolLM2 tokenizer. Each measurement is a fresh process: its peak resident set (``ru_maxrss``) while
loading, what stays resident after, and the bytes of the rows. With ``--cache`` the data cache is on (a fresh
directory): a first load that tokenizes and writes the entry, then a second that reads it.

    python benchmarks/data_memory.py [--copies 10] [--seq-len 2048] [--cache] [--code DIR] [--format parquet|json]
                                     [--max-documents N]

``--code DIR`` measures the memfit at DIR (a worktree of another commit, e.g. ``git worktree add /tmp/old HEAD~3``)
instead of this one. ``--format parquet`` writes the same records as one Parquet file (pyarrow's default row groups),
``--format json`` as one JSON array on one line (``json.dump``'s default), and loads that. Prints one JSON line per
load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, resource, sys, time
from memfit.config.schema import DataConfig
from memfit.models.load import ModelSource, embedded_checkpoint_dir, load_tokenizer
from memfit.train.data import load_dataset

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

tok = load_tokenizer(ModelSource("hf", path=embedded_checkpoint_dir()))
before = rss("VmRSS:")
t = time.perf_counter()
limit = int(sys.argv[3]) if sys.argv[3] != "all" else None
ds = load_dataset(DataConfig(source=sys.argv[1], seq_len=int(sys.argv[2]), max_documents=limit), tok)
seconds = time.perf_counter() - t
rows = sum(x.numel() * x.element_size() for x in (ds.tokens, ds.labels, ds.positions) if x is not None)
print(json.dumps({"seconds": round(seconds, 1), "rows": len(ds), "records": ds.records,
                  "rss_before_gib": round(before / 2**30, 3), "peak_rss_gib": round(rss("VmHWM:") / 2**30, 3),
                  "rss_after_gib": round(rss("VmRSS:") / 2**30, 3), "rows_gib": round(rows / 2**30, 3)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--cache", action="store_true", help="data cache on: a first load and a second")
    ap.add_argument("--code", type=Path, default=ROOT, help="the memfit tree to measure (default: this one)")
    ap.add_argument("--format", choices=("jsonl", "parquet", "json"), default="jsonl")
    ap.add_argument("--max-documents", type=int, help="data.max_documents: the first records only")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from memfit.train.plays import plays_chat_file

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / f"chat-x{a.copies}.jsonl"
        one = plays_chat_file().read_bytes()
        with open(source, "wb") as fh:
            for _ in range(a.copies):
                fh.write(one)
        if a.format != "jsonl":
            records = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
            source.unlink()
            source = source.with_suffix(f".{a.format}")
            if a.format == "json":
                source.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
            else:
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.Table.from_pylist(records), source)
            del records
        env = {**os.environ, "PYTHONPATH": str(a.code.resolve())}
        env["MEMFIT_DATA_CACHE"] = str(Path(tmp) / "cache") if a.cache else "off"
        for load in ("first", "second") if a.cache else ("uncached",):
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(source), str(a.seq_len), str(a.max_documents or "all")],
                env=env,
                cwd=tmp,  # not a checkout: ``-c`` puts the working directory before PYTHONPATH
                capture_output=True,
                text=True,
                check=True,
            )
            result = json.loads(done.stdout.strip().splitlines()[-1])
            info = {"load": load, "code": str(a.code), "file_bytes": source.stat().st_size, "format": a.format}
            info["max_documents"] = a.max_documents
            print(json.dumps({**info, **result}), flush=True)


if __name__ == "__main__":
    main()
